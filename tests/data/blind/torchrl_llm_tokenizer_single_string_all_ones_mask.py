# pytorch/rl#4237: the LLM Tokenizer transform's call_tokenizer_fn tokenized a single string with
# tokenizer.encode(...) and then used torch.ones_like(out) as its attention_mask, so with max_length padding the
# pad tokens were marked as attended; the fix calls the tokenizer like the batch path and keeps its real mask.
import sys

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WORDS = "<pad> <unk> the policy picks an action and gets a reward from environment".split()


def build_tokenizer():
    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    tokenizer.padding_side = "left"  # prompts are left-padded for generation
    return tokenizer


class Tokenizer:
    """Text -> tokens transform (reduced): in_keys text, out_keys tokens and attention_mask."""

    def __init__(self, tokenizer, max_length=None, return_attention_mask=True):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.return_attention_mask = return_attention_mask

    def call_tokenizer_fn(self, value):
        kwargs = {"add_special_tokens": False}
        if self.max_length is not None:
            kwargs["padding"] = "max_length"
            kwargs["max_length"] = self.max_length
        if isinstance(value, str):
            if FIXED:
                out = self.tokenizer(value, return_tensors="pt", return_attention_mask=self.return_attention_mask, **kwargs)
                if self.return_attention_mask:
                    attention_mask = out["attention_mask"][0]
                out = out["input_ids"][0]
            else:
                out = self.tokenizer.encode(value, return_tensors="pt", **kwargs)[0]
                # TODO: incorporate attention mask
                if self.return_attention_mask:
                    attention_mask = torch.ones_like(out, dtype=torch.int64)
        else:
            kwargs["return_attention_mask"] = self.return_attention_mask
            out = self.tokenizer(value, return_tensors="pt", **kwargs)
            if self.return_attention_mask:
                attention_mask = out["attention_mask"]
            out = out["input_ids"]
        if self.return_attention_mask:
            return out, attention_mask
        return out

    def __call__(self, td):
        td["tokens"], td["attention_mask"] = self.call_tokenizer_fn(td["text"])
        return td


class TransformersWrapper:
    """Policy wrapper computing next-token log-probs from tokens + attention_mask."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, td):
        tokens = td["tokens"].unsqueeze(0)
        mask = td["attention_mask"].unsqueeze(0)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=position_ids).logits
        td["next_token_log_probs"] = logits[0, -1].log_softmax(-1)
        return td


def main():
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, attn_implementation="sdpa")
    policy = TransformersWrapper(LlamaForCausalLM(config).eval())

    prompt = "the policy picks an action"
    td = policy(Tokenizer(tokenizer, max_length=12)({"text": prompt}))
    ref = policy(Tokenizer(tokenizer)({"text": prompt}))  # same prompt, no padding at all
    print("attention_mask:", td["attention_mask"].tolist())
    diff = (td["next_token_log_probs"] - ref["next_token_log_probs"]).abs().max().item()
    print(f"fixed={FIXED} max |next-token logp (padded) - logp (unpadded)| = {diff:.3e}")


if __name__ == "__main__":
    main()
