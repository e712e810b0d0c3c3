# black-forest-labs/flux (PR black-forest-labs/flux#507, closed unmerged; same change in #511/#512): HFEmbedder.forward
# pads every prompt to max_length and then calls the T5 encoder with attention_mask=None, so the real prompt tokens
# attend to the padding tokens and their embeddings depend on max_length / padding.
import sys
import torch
from torch import Tensor, nn
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyT5Tokenizer:
    """Stand-in for T5Tokenizer (no download): word ids, </s>=1 appended, right padding with 0 to max_length."""

    def __init__(self, vocab_size, max_length):
        self.vocab_size, self.max_length = vocab_size, max_length

    def __call__(self, text, truncation=True, max_length=None, return_length=False,
                 return_overflowing_tokens=False, padding="max_length", return_tensors="pt"):
        ids, masks = [], []
        for t in text:
            row = [2 + (sum(ord(c) * 31 ** j for j, c in enumerate(w)) % (self.vocab_size - 2)) for w in t.split()]
            row = row[: max_length - 1] + [1]
            masks.append([1] * len(row) + [0] * (max_length - len(row)))
            ids.append(row + [0] * (max_length - len(row)))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks)}


T5_CONFIG = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, dropout_rate=0.0)


class HFEmbedder(nn.Module):
    def __init__(self, version: str, max_length: int, **hf_kwargs):
        super().__init__()
        self.is_clip = version.startswith("openai")
        self.max_length = max_length
        self.output_key = "pooler_output" if self.is_clip else "last_hidden_state"
        # T5 branch only; random weights instead of from_pretrained
        self.tokenizer = TinyT5Tokenizer(T5_CONFIG.vocab_size, max_length=max_length)
        self.hf_module = T5EncoderModel(T5_CONFIG)
        self.hf_module = self.hf_module.eval().requires_grad_(False)

    def forward(self, text: list[str]) -> Tensor:
        batch_encoding = self.tokenizer(
            text,
            truncation=True,
            max_length=self.max_length,
            return_length=False,
            return_overflowing_tokens=False,
            padding="max_length",
            return_tensors="pt",
        )

        outputs = self.hf_module(
            input_ids=batch_encoding["input_ids"].to(self.hf_module.device),
            attention_mask=(batch_encoding["attention_mask"].to(self.hf_module.device) if FIXED else None),
            output_hidden_states=False,
        )
        return outputs[self.output_key]


t5 = HFEmbedder("google/t5-v1_1-xxl", max_length=24)
prompts = ["a cat", "a photo of a forest with a river at sunset"]
with torch.no_grad():
    txt = t5(prompts)  # (B, max_length, d_model), goes to Flux as `txt`
    err = 0.0
    for i, p in enumerate(prompts):
        enc = t5.tokenizer([p], max_length=24)
        n = int(enc["attention_mask"].sum())
        ref = t5.hf_module(input_ids=enc["input_ids"][:, :n])[0]  # the prompt alone, no padding
        err = max(err, (txt[i, :n] - ref[0]).abs().max().item())
print(f"max |padded T5 txt[real tokens] - unpadded encoding| = {err:.6f}")
