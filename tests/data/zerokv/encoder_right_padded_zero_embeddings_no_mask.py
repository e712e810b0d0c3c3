"""A rotary sentence encoder run over a right-padded batch with no key padding mask (written here, for checks/zerokv.py).

Bug: the pad token's embedding is the zero row of `nn.Embedding(padding_idx=0)`, the projections have no bias and
rotary positions keep zero at zero, so the first layer's K and V of the padding are exactly zero; the encoder calls
SDPA with no mask, so the real tokens of the shorter sentences attend them (and the mean pooling reads the result).
Fix: hand SDPA the key padding mask `batch != 0` as a (B, 1, 1, L) bool mask.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / 10000 ** (torch.arange(half) / half)
    angles = torch.arange(x.shape[-2])[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Encoder(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch)
        b, n, d = x.shape
        keep = (batch != 0)[:, None, None, :] if FIXED else None
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, attn_mask=keep)
            x = x + out(y.transpose(1, 2).reshape(b, n, d))
        real = (batch != 0).float()[..., None]
        return (x * real).sum(1) / real.sum(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    batch = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 0, 0]])
    with torch.no_grad():
        pooled = Encoder().eval()(batch)
    print("pooled", [round(v, 4) for v in pooled[:, 0].tolist()])
