"""A local layer whose cache is a ring of W = 4 slots, prefilled in chunks of 3 beside a global layer whose cache
grows: the buggy mask opens every written ring slot to every row of the chunk (row k sees the ring and k + 1 chunk
keys); `--fixed` opens ring slot s to row k only where its position is within the window of the row's own. Written as
a second form of pytorch/executorch#21857, differently: a growing global cache beside the ring, SDPA with a bool mask,
a batch of two, chunks of 3."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
W, CHUNK = 4, 3  # the local layer's window (keys, its own included) and ring size; the prefill's chunk


class Layer(nn.Module):
    def __init__(self, local, d=16, heads=2):
        super().__init__()
        self.local, self.heads, self.qkv = local, heads, nn.Linear(d, 3 * d)
        self.k = self.v = None
        self.positions = []  # the position each cached key holds

    def forward(self, x, start):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        own = torch.arange(start, start + n)
        cached = torch.tensor(self.positions, dtype=torch.long)
        keys_k = k if self.k is None else torch.cat([self.k, k], 2)
        keys_v = v if self.v is None else torch.cat([self.v, v], 2)
        positions = torch.cat([cached, own])
        keep = positions[None, :] <= own[:, None]
        if self.local and FIXED:
            keep &= own[:, None] - positions[None, :] < W
        out = F.scaled_dot_product_attention(q, keys_k, keys_v, attn_mask=keep)
        self.k, self.v, self.positions = keys_k, keys_v, positions.tolist()
        if self.local:  # the ring keeps the last W keys
            self.k, self.v, self.positions = self.k[:, :, -W:], self.v[:, :, -W:], self.positions[-W:]
        return out.transpose(1, 2).reshape(b, n, d)


torch.manual_seed(0)
layers = nn.ModuleList([Layer(local=False), Layer(local=True)])
x = torch.randn(2, 12, 16)
with torch.no_grad():
    for start in range(0, 12, CHUNK):
        h = x[:, start:start + CHUNK]
        for layer in layers:
            h = layer(h, start)
print("fixed" if FIXED else "buggy")
