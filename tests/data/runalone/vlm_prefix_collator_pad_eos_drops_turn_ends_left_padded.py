# The LLaVA-NeXT pad == eos bug (LLaVA-VL/LLaVA-NeXT db8bc66) written another way: a ChatML-style captioning model
# of its own (no transformers), left padding, a config dataclass stating pad_id == eos_id (<|im_end|>), the collator's
# mask `ids != pad_id`. The model keeps each row's real tokens by that mask, puts the image's prefix embeddings in
# front, re-pads on the left and runs SDPA with causal AND key padding: every real <|im_end|> closing a turn is
# dropped. The reference runs each sample alone, every token kept. Fixed: the mask from the samples' lengths.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class CaptionConfig:
    vocab: int = 48
    dim: int = 32
    heads: int = 4
    layers: int = 2
    prefix: int = 3  # image embeddings put before the text
    im_end_id: int = 2
    pad_id: int = 2  # the tokenizer has no pad token: its eos pads


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.ff = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x, keep):  # keep: (B, T) bool, True = a real key
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool)[None, None]  # (a padded query sees itself: no NaN row)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class Captioner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.vision = nn.Linear(8, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, input_ids, pixel_values, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows = []
        for ids, keep, image in zip(input_ids, attention_mask.bool(), pixel_values):
            rows.append(torch.cat([self.vision(image), self.embed(ids[keep])]))  # the text the mask keeps
        longest = max(len(r) for r in rows)
        x = torch.stack([F.pad(r, (0, 0, longest - len(r), 0)) for r in rows])  # left padding again
        real = torch.stack([torch.arange(longest) >= longest - len(r) for r in rows])
        for block in self.blocks:
            x = block(x, real)
        return self.head(x)


cfg = CaptionConfig()
samples = [[5, 9, 11, 2, 6, 13, 17, 19, 2], [5, 21, 2, 6, 23, 2], [5, 30, 31, 32, 2, 6, 40, 2]]
images = torch.randn(len(samples), cfg.prefix, 8)
longest = max(len(s) for s in samples)
input_ids = torch.tensor([[cfg.pad_id] * (longest - len(s)) + s for s in samples])  # left-padded
if FIXED:
    lengths = torch.tensor([len(s) for s in samples])
    attention_mask = (torch.arange(longest)[None] >= (longest - lengths)[:, None]).long()
else:
    attention_mask = (input_ids != cfg.pad_id).long()

model = Captioner(cfg).eval()
with torch.no_grad():
    batched = model(input_ids, images, attention_mask=attention_mask)
    worst = 0.0
    for b, s in enumerate(samples):
        alone = model(torch.tensor([s]), images[b:b + 1])
        worst = max(worst, (batched[b, -1] - alone[0, -1]).abs().max().item())
real = torch.arange(longest)[None] >= torch.tensor([longest - len(s) for s in samples])[:, None]
print(f"real tokens the collator's mask calls padding = {int((real & (attention_mask == 0)).sum())}")
print(f"max |last logits batched - each sample alone| = {worst:.6f}")
