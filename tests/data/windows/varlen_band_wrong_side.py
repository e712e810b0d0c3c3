"""A sliding layer over packed sequences given flash's cu_seqlens_q / cu_seqlens_k: the band on the wrong side.

Bug: the per-sequence mask keeps k < p + W (the window's bound put after the query), so each query sees every older
key of its sequence and W - 1 later ones. Fix: p - W < k <= p. The window is stated by a dataclass config with
layer_types; the queries of each sequence are its last ones (the new tokens after its cached keys).
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["sliding_attention"])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Config()
        self.q = nn.Linear(8, 8)
        self.kv = nn.Linear(8, 16)

    def forward(self, new, keys_in, cu_seqlens_q, cu_seqlens_k):
        q = self.q(new).view(1, -1, 2, 4).transpose(1, 2)
        k, v = self.kv(keys_in).view(1, -1, 2, 2, 4).permute(2, 0, 3, 1, 4)
        mask = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool)
        w = self.config.sliding_window
        for i in range(len(cu_seqlens_q) - 1):
            q0, q1, k0, k1 = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
            p = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            j = torch.arange(k1 - k0)[None, :]
            mask[q0:q1, k0:k1] = ((j <= p) & (j > p - w)) if FIXED else (j < p + w)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


torch.manual_seed(0)
cu_q, cu_k = torch.tensor([0, 5, 7]), torch.tensor([0, 5, 11])  # a fresh prompt of 5, two new tokens after 4 cached
with torch.no_grad():
    out = Attention()(torch.randn(1, 7, 8), torch.randn(1, 11, 8), cu_q, cu_k)
print("done", tuple(out.shape))
