# Written another way (trace/given.py, checks/dropped.py: mask-argument-dropped, an additive bias read as a bool mask):
# an ALiBi encoder whose attention helper takes `attn_bias` (the per-head distance bias plus -inf on padded keys) and
# hands SDPA `attn_mask=attn_bias.bool()`: SDPA's bool mask keeps True, so every nonzero cell is kept (the padding too,
# -inf being nonzero) and the zero diagonal is masked; the bias itself is never added. Right-padded batch of 7, 5, 3.
# --fixed: `attn_mask=attn_bias` (a float mask, added to the scores).
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def alibi_slopes(heads: int) -> torch.Tensor:
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


def attention(q, k, v, attn_bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias if FIXED else attn_bias.bool())


class AlibiLayer(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, attn_bias):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(attention(q, k, v, attn_bias).transpose(1, 2).reshape(b, n, d))
        return x + self.ff(self.norm2(x))


class AlibiEncoder(nn.Module):
    def __init__(self, vocab=30, dim=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(AlibiLayer(dim, heads) for _ in range(layers))

    def forward(self, ids, lengths):
        n = ids.shape[1]
        distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs()
        bias = -alibi_slopes(self.heads)[:, None, None] * distance  # (H, L, L)
        padded = torch.arange(n)[None, :] >= lengths[:, None]  # (B, L)
        attn_bias = bias[None] + torch.zeros(len(ids), 1, 1, n).masked_fill(padded[:, None, None, :], -math.inf)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, attn_bias)
        keep = (~padded).float()[..., None]
        return (x * keep).sum(1) / keep.sum(1)


lengths = torch.tensor([7, 5, 3])
ids = torch.randint(1, 30, (3, 7)) * (torch.arange(7)[None, :] < lengths[:, None])
model = AlibiEncoder().eval()
with torch.no_grad():
    pooled = model(ids, lengths)
print("pooled norms", [round(float(x), 4) for x in pooled.norm(dim=-1)])
