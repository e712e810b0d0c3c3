"""A chunked layer whose cache keeps the last C - 1 keys plus the new one: at decode the chunk is cut off.

Bug: the decode mask labels the cache's keys as if the cache started at position 0 (key j at position j), so the
query sees the wrong keys of its chunk. Fix: key j of the k_len held is at position p - k_len + 1 + j. The chunk
size is stated in a SimpleNamespace the model keeps (self.args), with layer_types.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
C, D = 3, 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.k = self.v = None

    def forward(self, x, pos):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        keys, values = self.k[:, :, -(C - 1 + x.shape[1]):], self.v[:, :, -(C - 1 + x.shape[1]):]
        self.k, self.v = self.k[:, :, -(C - 1):], self.v[:, :, -(C - 1):]
        n = keys.shape[2]
        qp = torch.arange(pos, pos + x.shape[1])
        kp = torch.arange(pos + x.shape[1] - n, pos + x.shape[1]) if FIXED else torch.arange(n)
        mask = (kp[None, :] <= qp[:, None]) & (kp[None, :] // C == qp[:, None] // C)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.args = SimpleNamespace(attention_chunk_size=C, layer_types=["chunked_attention"], dim=D)
        self.layers = nn.ModuleList([Layer()])

    def forward(self, x, position_ids):
        for layer in self.layers:
            x = x + layer(x, int(position_ids[0, 0]))
        return x


torch.manual_seed(0)
model = Model()
with torch.no_grad():
    model(torch.randn(1, 4, D), torch.arange(4)[None])
    for pos in range(4, 8):
        out = model(torch.randn(1, 1, D), torch.tensor([[pos]]))
print("done", tuple(out.shape))
