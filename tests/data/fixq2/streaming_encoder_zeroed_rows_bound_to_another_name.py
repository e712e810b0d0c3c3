"""A left-padded encoder whose padding rows are zeroed after the softmax into a copy it never reads.

Written for maskcli's zeroing-lost rule (a second program beside flamingo-pytorch 10913ab, written another way):
the query-and-key mask empties the padding queries' rows, filled with -inf, so their softmax is NaN; the program
zeroes them with `torch.masked_fill(...)` but binds the result to a name the product never reads (a typo), so
`torch.matmul(attn, v)` reads the NaN rows, and the second layer's real queries read NaN values.
Fix: read the zeroed weights.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, real):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        pair = real[:, None, :, None] & real[:, None, None, :]
        scores = scores.masked_fill(~pair, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        p_attn = torch.masked_fill(attn, ~real[:, None, :, None], 0.0)
        out = torch.matmul(p_attn if FIXED else attn, v)
        return x + self.out(out.transpose(1, 2).reshape(b, t, d))


if __name__ == "__main__":
    torch.manual_seed(0)
    layers = nn.ModuleList([Layer(16, 2) for _ in range(2)]).eval()
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()  # left-padded
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        for layer in layers:
            x = layer(x, real)
    print("row 0 last token", [round(v, 4) for v in x[0, -1, :3].tolist()])
