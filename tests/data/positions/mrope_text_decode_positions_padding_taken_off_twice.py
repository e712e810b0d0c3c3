"""A hand-written vision-language decoder with multimodal rope (Qwen2-VL's three position rows: temporal, height,
width), greedy-decoding a left-padded batch of text prompts over a cache.

Written for maskcli's tests (checks/positioned.py), the bug of transformers#40490 written another way. The prefill
numbers each row's real tokens from 0 (the pads at 1, masked) and keeps `rope_deltas = max position + 1 - padded
length`, which for a left-padded row already takes its pad count off. Each decode step must place its token at
`cache length + rope_deltas`. The bug: the step counts the row's real tokens from the attention mask (pads already
skipped) and adds `rope_deltas` too, so a padded row's new token sits its pad count before the keys it sees. Fixed:
`cache length + rope_deltas`. The unpadded row is the same either way.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
HIDDEN, HEADS, VOCAB = 32, 4, 50


def rotate(x, positions):
    """Multimodal rope: the head's dims split in three, each rotated by one of the (3, B, L) position rows."""
    dim = x.shape[-1] // 6
    freqs = 1.0 / (10000 ** (torch.arange(dim, dtype=torch.float32) / dim))
    out = []
    for row, part in zip(positions, x.split(2 * dim, dim=-1)):
        angle = row[:, None, :, None].float() * freqs  # (B, 1, L, dim)
        a, b = part[..., :dim], part[..., dim:]
        out.append(torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1))
    return torch.cat(out, dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, positions, keep, cache):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = rotate(q, positions), rotate(k, positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(y.transpose(1, 2).reshape(b, n, -1)), (k, v)


class VLDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids, caches=None):
        n, total = input_ids.shape[1], attention_mask.shape[1]
        causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        x, new = self.embed(input_ids), []
        for i, layer in enumerate(self.layers):
            h, kv = layer(x, position_ids, keep, None if caches is None else caches[i])
            x, new = x + h, new + [kv]
        return self.head(x), new


torch.manual_seed(0)
model = VLDecoder().eval()
prompts = [[5, 9, 14, 3, 22, 7, 11], [8, 2, 30]]
length = max(len(p) for p in prompts)
input_ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
attention_mask = (torch.arange(length)[None] >= torch.tensor([length - len(p) for p in prompts])[:, None]).long()
text = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
position_ids = text[None].expand(3, -1, -1)  # (a text prompt: its three rows alike)
rope_deltas = position_ids.max(0)[0].max(-1, keepdim=True)[0] + 1 - length  # (B, 1)
generated = []
with torch.no_grad():
    logits, caches = model(input_ids, attention_mask, position_ids)
    for step in range(4):
        token = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token[:, 0].tolist())
        cache_length = attention_mask.shape[1]
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        if FIXED:
            at = torch.full_like(token, cache_length) + rope_deltas
        else:
            at = (attention_mask.cumsum(-1) - 1)[:, -1:] + rope_deltas
        logits, caches = model(token, attention_mask, at[None].expand(3, -1, -1), caches)
print("generated:", generated)
