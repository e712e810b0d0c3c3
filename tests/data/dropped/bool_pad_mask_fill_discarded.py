"""A hand-written encoder layer handed a bool key padding mask (True = padding, left-padded) that never masks the scores.

Written another way than diffusers#11065's Flux processor (tests/data/bugs/diffusers_flux_attn_processor_drops_attention_mask.py):
the other polarity (True = a padded key, as nn.MultiheadAttention's key_padding_mask), padding on the left, an eager
softmax instead of SDPA, the mask named `mask` as (B, 1, 1, L). The bug: `scores.masked_fill(mask, -inf)` is not in place
and its result is dropped, so every query attends the padding. Fixed: `scores = scores.masked_fill(...)`.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class EncoderLayer(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def attend(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        if FIXED:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores.masked_fill(mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, -1))

    def forward(self, x, mask):
        return x + self.attend(x, mask)


def main():
    torch.manual_seed(0)
    layer = EncoderLayer().eval()
    lengths = torch.tensor([5, 3])
    n = int(lengths.max())
    is_pad = torch.arange(n)[None, :] < (n - lengths)[:, None]  # left padding: the first n - len positions
    x = torch.randn(2, n, 16)
    with torch.no_grad():
        y = layer(x, is_pad[:, None, None, :])
    print("out", tuple(y.shape), [round(v, 4) for v in y[1, -1, :3].tolist()])


if __name__ == "__main__":
    main()
