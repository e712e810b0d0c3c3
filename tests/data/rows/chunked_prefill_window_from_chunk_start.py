"""Chunked prefill of a sliding-window layer behind a growing cache, left-padded batch: each chunk's window measured
from the chunk's first query, so later queries of a chunk see past their window (--fixed: from each query)."""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
W, CHUNK = 4, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(sliding_window=W)
        self.proj = nn.Linear(8, 24)

    def forward(self, x, attention_mask, cache_position, past=None):
        q, k, v = self.proj(x)[:, None].chunk(3, -1)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        kp = torch.arange(k.shape[2])
        anchor = cache_position[:, None] if FIXED else cache_position[:1, None]
        mask = (kp[None, :] <= cache_position[:, None]) & (anchor - kp[None, :] < W)
        mask = mask[None] & attention_mask.bool()[:, None, : k.shape[2]]
        mask = mask | ~mask.any(-1, keepdim=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]), (k, v)


torch.manual_seed(0)
m = Layer()
am = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12])
x = torch.randn(2, 12, 8)
past = None
for start in range(0, 12, CHUNK):
    _, past = m(x[:, start:start + CHUNK], am[:, :start + CHUNK], torch.arange(start, start + CHUNK), past)
