# TransformerLensOrg/TransformerLens#1761 (fixes #1760): TransformerBridge.hf_generate() right-padded a
# batch of string prompts and never forwarded the tokenizer's attention_mask to HF generate(), so the
# shorter prompt's new tokens attended its pad tokens. Fix: left-pad and pass attention_mask.
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EOS = 0


class ToyTokenizer:
    """Stands in for the GPT-2 tokenizer (pad_token = eos_token, padding_side = 'right')."""

    pad_token_id = EOS
    eos_token_id = EOS
    padding_side = "right"

    def encode(self, text):
        return [1 + (ord(c) % 90) for c in text]

    def __call__(self, texts, padding=True, return_tensors="pt"):
        ids = [self.encode(t) for t in texts]
        width = max(len(x) for x in ids)
        input_ids, mask = [], []
        for x in ids:
            pad = [self.pad_token_id] * (width - len(x))
            m = [0] * len(pad)
            if self.padding_side == "left":
                input_ids.append(pad + x)
                mask.append(m + [1] * len(x))
            else:
                input_ids.append(x + pad)
                mask.append([1] * len(x) + m)
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(mask)}


class TransformerBridge:
    def __init__(self, original_model, tokenizer):
        self.original_model = original_model
        self.tokenizer = tokenizer

    def to_tokens(self, input):
        return self.tokenizer(input)["input_ids"]

    @torch.no_grad()
    def hf_generate(self, input, max_new_tokens=4, generation_kwargs=None, **kwargs):
        generation_kwargs = dict(generation_kwargs) if generation_kwargs is not None else {}
        generation_kwargs.update(kwargs)
        if isinstance(input, list) and FIXED:
            original_side = self.tokenizer.padding_side
            self.tokenizer.padding_side = "left"
            try:
                enc = self.tokenizer(input)
            finally:
                self.tokenizer.padding_side = original_side
            input_ids = enc["input_ids"]
            generation_kwargs["attention_mask"] = enc["attention_mask"]
        elif isinstance(input, list):
            input_ids = self.to_tokens(input)
        else:
            input_ids = self.to_tokens([input])
        return self.original_model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_scores=True,
            **generation_kwargs,
        )


def main():
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    model = GPT2LMHeadModel(config).eval()
    model.config._attn_implementation = "sdpa"
    bridge = TransformerBridge(model, ToyTokenizer())

    prompts = ["hi there", "a much longer prompt here"]
    batched = bridge.hf_generate(prompts, max_new_tokens=4)
    single = bridge.hf_generate(prompts[0], max_new_tokens=4)
    diff = max((b[0] - s[0]).abs().max().item() for b, s in zip(batched.scores, single.scores))
    print(f"fixed={FIXED} short prompt batched-vs-single max|logit diff| = {diff:.4f}")


if __name__ == "__main__":
    main()
