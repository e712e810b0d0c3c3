"""A set encoder whose padding mask is the outer product of the real flags: padded queries see no key (NaN rows), and
the next layers read those NaN outputs as values, so real items end NaN.

Bug: `pair = real[:, :, None] & real[:, None, :]` masks padded query rows entirely; `masked_fill(~pair, -inf)` then
softmax gives NaN rows, the padded items' outputs are NaN, and (0 weight * NaN value = NaN) every real item of that
row is NaN after the next layer, so the third layer's real queries score NaN.
Fix (--fixed): mask only the padded keys, `real[:, None, :]` broadcast over the queries.
Written for maskcli's tests (checks/nans.py), unlike dgl#5476's additive bias: a masked_fill, heads by einsum,
the set right-padded in one row and left-padded in the other.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class SetLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, real):
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads) for t in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        keep = real[:, None, :].expand(b, n, n) if FIXED else real[:, :, None] & real[:, None, :]
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        weights = scores.softmax(dim=-1)
        return x + self.out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    layers = nn.ModuleList(SetLayer(16, 2) for _ in range(3)).eval()
    x = torch.randn(2, 6, 16)
    real = torch.tensor([[True, True, True, True, False, False], [False, True, True, True, True, True]])
    with torch.no_grad():
        for layer in layers:
            x = layer(x, real)
    print("NaN items per set", torch.isnan(x).any(-1).sum(-1).tolist())


if __name__ == "__main__":
    main()
