"""OpenCompass's HuggingFace base-model generation: left-padded, left-truncated batched greedy decode.

Ported from open-compass/opencompass opencompass/models/huggingface_above_v4_33.py
(stored version 01338e40), class HuggingFaceAboveV433Base:
  * _load_tokenizer(): DEFAULT_TOKENIZER_KWARGS = dict(padding_side='left', truncation_side='left'),
    pad_token_id falling back to eos when the tokenizer has none set (here a real pad id is given),
  * _load_model(): model.eval(); model.generation_config.do_sample = False,
  * generate(): batch_encode_plus(messages, padding=True, truncation=True,
    max_length=self.max_seq_len - max_out_len) -> input_ids + attention_mask (0 on the left pads),
    model.generate(**tokens, max_new_tokens=max_out_len, ...),
    outputs = outputs[:, tokens['input_ids'].shape[1]:]  (the new tokens, aligned because of left pad),
    then the stop words cut the decoded strings.
The model is transformers' Qwen2ForCausalLM from a tiny Qwen2Config (no download), SDPA attention;
generate() derives position ids from the attention mask and extends the mask at every cached step.

Check: every prompt decoded alone (no padding, no KV cache, a plain argmax loop over the whole
prefix, stopping at EOS) gives the same new tokens as the batched left-padded generate.
"""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)

VOCAB = 96
PAD, EOS = 0, 1


class TinyTokenizer:
    """Byte-ish tokenizer: chars map to 2 + (ord % 94)."""

    def __init__(self, padding_side="left", truncation_side="left"):
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.pad_token_id = PAD
        self.eos_token_id = EOS

    def encode(self, s):
        return [2 + (ord(c) % (VOCAB - 2)) for c in s]

    def decode(self, ids):
        return "".join(chr(32 + (i - 2) % 94) if i >= 2 else "" for i in ids)

    def batch_encode_plus(self, texts, padding=True, truncation=True, max_length=None, **_):
        encs = [self.encode(t) for t in texts]
        if truncation and max_length is not None:
            encs = [e[-max_length:] if self.truncation_side == "left" else e[:max_length] for e in encs]
        L = max(len(e) for e in encs)
        ids, mask = [], []
        for e in encs:
            n = L - len(e)
            if self.padding_side == "left":
                ids.append([self.pad_token_id] * n + e)
                mask.append([0] * n + [1] * len(e))
            else:
                ids.append(e + [self.pad_token_id] * n)
                mask.append([1] * len(e) + [0] * n)
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


class HuggingFaceBaseWrapper:
    def __init__(self, model, tokenizer, max_seq_len):
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.model.eval()
        self.model.generation_config.do_sample = False

    def generate(self, inputs, max_out_len):
        tokenize_kwargs = dict(return_tensors="pt", padding=True, truncation=True, add_special_tokens=True,
                               max_length=self.max_seq_len - (max_out_len or 0))
        tokens = self.tokenizer.batch_encode_plus(inputs, **tokenize_kwargs)
        generation_kwargs = dict(max_new_tokens=max_out_len, pad_token_id=self.tokenizer.pad_token_id,
                                 eos_token_id=self.tokenizer.eos_token_id, do_sample=False)
        outputs = self.model.generate(**tokens, **generation_kwargs)
        outputs = outputs[:, tokens["input_ids"].shape[1]:]
        return tokens, outputs


def greedy_alone(model, ids, max_new):
    """Reference: one prompt, no padding, no cache, full recompute each step."""
    seq = list(ids)
    new = []
    for _ in range(max_new):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        nxt = int(logits.argmax())
        new.append(nxt)
        seq.append(nxt)
        if nxt == EOS:
            break
    return new


def main():
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    tok = TinyTokenizer(padding_side="left", truncation_side="left")
    max_seq_len, max_out_len = 40, 8
    wrapper = HuggingFaceBaseWrapper(model, tok, max_seq_len)

    prompts = [
        "Q: 2+2? A:",
        "Question: which planet is the largest in the solar system? Answer it briefly please. A:",
        "Hi",
    ]
    with torch.no_grad():
        tokens, outputs = wrapper.generate(prompts, max_out_len)
        print("input_ids", tuple(tokens["input_ids"].shape), "left pads per row",
              (tokens["attention_mask"] == 0).sum(1).tolist())
        ok = True
        max_len = max_seq_len - max_out_len
        for b, p in enumerate(prompts):
            ids = tok.encode(p)[-max_len:]  # the same left truncation
            ref = greedy_alone(model, ids, max_out_len)
            got = outputs[b].tolist()
            # after EOS the batched generate writes pad ids
            got_cut = got[: len(ref)]
            tail = got[len(ref):]
            same = got_cut == ref and all(t == PAD for t in tail)
            ok &= same
            print(f"prompt {b}: len {len(ids)}, batched {got} alone {ref} -> {'ok' if same else 'DIFF'}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
