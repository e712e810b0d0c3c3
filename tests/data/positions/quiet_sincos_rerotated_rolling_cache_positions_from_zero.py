"""A rolling-cache decoder (StreamingLLM-style) that caches its keys unrotated and re-rotates the whole cache each step.

Correct, and of the shape of transformers#22416's bug: every call numbers its positions from 0 again, yet its table
spans every key the cache holds (positions 0..S-1 for the S keys, the query at S-1), so each query sees its keys at
their true distances, as many positions as keys. A joined `sincos` table (sin then cos), an `inv_freq` buffer, eager
softmax behind an additive causal mask, the cache cut to its last 6 keys before each step. positions-vs-keys must stay
quiet (the table goes as far as the keys count).
"""
import math
import sys

import torch
from torch import nn

torch.manual_seed(0)
WINDOW = 6
_ = "--fixed" in sys.argv  # (correct either way)


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, n):
        angles = torch.arange(n).float()[:, None] * self.inv_freq
        return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (n, dim): sin | cos


def rotate(x, sincos):  # transformers' halves
    sin, cos = sincos.chunk(2, dim=-1)
    sin, cos = torch.cat([sin, sin], -1), torch.cat([cos, cos], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.d = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.rotary = Rotary(self.d)

    def forward(self, x, cache):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, self.d).transpose(1, 2) for f in (self.q, self.k, self.v))
        if cache is not None:
            k = torch.cat([cache[0][:, :, -(WINDOW - t):], k], dim=2)
            v = torch.cat([cache[1][:, :, -(WINDOW - t):], v], dim=2)
        s = k.shape[2]
        sincos = self.rotary(s)  # positions 0..s-1 over the keys the cache holds now
        scores = rotate(q, sincos[s - t:]) @ rotate(k, sincos).transpose(-1, -2) / math.sqrt(self.d)
        mask = torch.full((t, s), float("-inf")).triu(diagonal=s - t + 1)
        probs = torch.softmax(scores + mask, dim=-1)
        return x + self.o((probs @ v).transpose(1, 2).reshape(b, t, -1)), (k, v)


layers = nn.ModuleList(Layer() for _ in range(2)).eval()
x = torch.randn(2, WINDOW, 32)
caches = [None, None]
with torch.no_grad():
    for step in range(5):
        h = x if step == 0 else x[:, -1:]
        for i, layer in enumerate(layers):
            h, caches[i] = layer(h, caches[i])
        x = torch.cat([x, h[:, -1:]], dim=1)
print(x.shape)
