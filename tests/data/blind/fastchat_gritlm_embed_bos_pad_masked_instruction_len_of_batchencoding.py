# lm-sys/FastChat commit 0f8692b2 ("Fix GritLM attention masks"), fastchat/serve/model_worker.py,
# ModelWorker.get_embeddings / __process_embed_chunk for GritLM (a Mistral model run with is_causal=False).
# Before the fix: (1) the key mask is built as `input_ids != tokenizer.pad_token_id`, but GritLM's tokenizer
# pads with its BOS id, so every row's BOS is masked out of the bidirectional attention and the pooling;
# (2) the instruction ("<|embed|>\n") is cut from the mean pooling with `len(instruction_tokens)`, where
# instruction_tokens is the BatchEncoding from encode_plus, so len() counts its keys (2), not its tokens.
# The fix sets attention_mask[:, 0] = 1 when pad == bos and takes len(encode_plus(...)["input_ids"]).
import sys

import torch
import torch.nn.functional as F
from transformers import BatchEncoding, MistralConfig, MistralForCausalLM

FIXED = "--fixed" in sys.argv

GRITLM_EMBED_INSTRUCTION = "<|embed|>\n"


class CharTokenizer:
    """Stands in for GritLM's Llama/Mistral tokenizer: <s> (id 1) is both bos and pad, right padding."""

    unk_token_id, bos_token_id, eos_token_id = 0, 1, 2
    pad_token_id = 1

    def __init__(self):
        chars = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?<>|\n"))
        self.vocab = {c: i + 3 for i, c in enumerate(chars)}

    def _ids(self, text, max_length=None, truncation=False):
        ids = [self.bos_token_id] + [self.vocab.get(c, self.unk_token_id) for c in text]
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return ids

    def encode_plus(self, text, padding=False, truncation=False, max_length=None):
        ids = self._ids(text, max_length, truncation)
        return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})

    def batch_encode_plus(self, texts, padding=True, truncation=False, return_tensors=None, max_length=None):
        rows = [self._ids(t, max_length, bool(truncation)) for t in texts]
        n = max(len(r) for r in rows)
        ids = [r + [self.pad_token_id] * (n - len(r)) for r in rows]
        mask = [[1] * len(r) + [0] * (n - len(r)) for r in rows]
        return BatchEncoding({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)})


class GritLMForCausalLM(MistralForCausalLM):
    pass


class ModelWorker:
    def __init__(self, model, tokenizer, context_len, embed_in_truncate=True, device="cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.embed_in_truncate = embed_in_truncate
        self.device = device
        self.call_ct = 0

    def _process_embed_chunk(self, input_ids, attention_mask, **model_type_dict):
        if model_type_dict.get("is_bert") or model_type_dict.get("is_gritlm"):
            if model_type_dict.get("is_gritlm"):
                model_output = self.model.model(
                    input_ids,
                    attention_mask=attention_mask,
                    is_causal=False,
                )

                instruction = GRITLM_EMBED_INSTRUCTION
                instruction_tokens = self.tokenizer.encode_plus(
                    instruction,
                    padding=False,
                    truncation=True,
                    max_length=self.context_len,
                )
                if FIXED:
                    instruction_tokens = instruction_tokens["input_ids"]
                attention_mask[:, : len(instruction_tokens)] = 0
            else:
                model_output = self.model(input_ids)
            data = model_output[0]
        else:
            model_output = self.model(input_ids, output_hidden_states=True)
            data = model_output.hidden_states[-1]

        if hasattr(self.model, "use_cls_pooling") and self.model.use_cls_pooling:
            sum_embeddings = data[:, 0]
        else:
            mask = attention_mask.unsqueeze(-1).expand(data.size()).float()
            masked_embeddings = data * mask
            sum_embeddings = torch.sum(masked_embeddings, dim=1)
        token_num = torch.sum(attention_mask).item()

        return sum_embeddings, token_num

    @torch.inference_mode()
    def get_embeddings(self, params):
        self.call_ct += 1
        tokenizer = self.tokenizer
        ret = {"embedding": [], "token_num": 0}

        model_type_dict = {
            "is_llama": "llama" in str(type(self.model)),
            "is_t5": "t5" in str(type(self.model)),
            "is_bert": "bert" in str(type(self.model)),
            "is_gritlm": "gritlm" in str(type(self.model)).lower(),
        }

        if model_type_dict.get("is_gritlm"):
            instruction = GRITLM_EMBED_INSTRUCTION
        else:
            instruction = ""

        encoding = tokenizer.batch_encode_plus(
            [instruction + text for text in params["input"]],
            padding=True,
            truncation="longest_first",
            return_tensors="pt",
            max_length=self.context_len,
        )
        input_ids = encoding["input_ids"].to(self.device)
        attention_mask = input_ids != tokenizer.pad_token_id
        if FIXED and model_type_dict.get("is_gritlm") and tokenizer.pad_token_id == tokenizer.bos_token_id:
            # BOS == PAD here, so fix it up.
            attention_mask[:, 0] = 1

        embedding, token_num = self._process_embed_chunk(input_ids, attention_mask, **model_type_dict)
        embedding = embedding / token_num
        normalized_embeddings = F.normalize(embedding, p=2, dim=1)
        ret["token_num"] = token_num
        ret["embedding"] = normalized_embeddings.tolist()
        return ret


def main():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=80,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=1,
    )
    config._attn_implementation = "sdpa"
    model = GritLMForCausalLM(config).eval()
    worker = ModelWorker(model, CharTokenizer(), context_len=64)
    ret = worker.get_embeddings(
        {"input": ["the cat sat on the mat.", "a dog barked at night, loudly!", "hello"]}
    )
    emb = torch.tensor(ret["embedding"])
    print("token_num:", ret["token_num"])
    print("embedding[:, :4]:", emb[:, :4])
    print("cosine(0,1):", float(emb[0] @ emb[1]), "cosine(0,2):", float(emb[0] @ emb[2]))


if __name__ == "__main__":
    main()
