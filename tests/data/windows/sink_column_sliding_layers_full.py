"""Sliding layers given the full causal mask, their softmax over scores joined to a learned sink column.

Written apart from TensorRT-Model-Connect#400's gpt-oss port: a dataclass config (`layer_types`, `sliding_window`),
4-D (batch, heads, Lq, Lk) scores by matmul, a per-head sink logit expanded over the batch and the queries and
joined by `torch.concat((scores, sink), dim=3)` (the sink column is no key: trace leaves it out), a bool mask filled
into the scores. Bug: one causal mask for every layer. Fixed: the sliding layers keep the last `sliding_window` keys.
"""
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    dim: int = 16
    heads: int = 2
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["full_attention", "sliding_attention", "sliding_attention"])


class Layer(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        self.layer_idx, self.heads = idx, cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.sinks = nn.Parameter(torch.zeros(cfg.heads))

    def forward(self, x, allowed):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        sink = self.sinks.view(1, -1, 1, 1).expand(b, -1, n, 1)
        weights = torch.concat((scores, sink), dim=3).softmax(dim=-1)[..., :-1]
        return x + (weights @ v).transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([Layer(cfg, i) for i in range(len(cfg.layer_types))])

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n)
        causal = pos[None, :] <= pos[:, None]
        window = causal & (pos[None, :] > pos[:, None] - self.cfg.sliding_window)
        for kind, layer in zip(self.cfg.layer_types, self.layers):
            x = layer(x, window if FIXED and kind == "sliding_attention" else causal)
        return x


torch.manual_seed(0)
with torch.no_grad():
    out = Model(Config())(torch.randn(2, 7, 16))
print("out", tuple(out.shape), round(float(out.sum()), 4))
