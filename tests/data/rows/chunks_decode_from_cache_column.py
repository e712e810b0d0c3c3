"""Chunked attention behind a KV cache, left-padded: the prefill counts chunks from each row's first token, the
decode step from the cache's column (--fixed: from the row's position)."""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
C = 4


class Chunked(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(attention_chunk_size=C, layer_types=["chunked_attention"])
        self.proj = nn.Linear(8, 24)

    def forward(self, x, attention_mask, position_ids, past=None):
        q, k, v = self.proj(x)[:, None].chunk(3, -1)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        kpos = attention_mask.cumsum(-1) - 1  # each key's position in its row
        qpos = position_ids if FIXED or past is None else torch.arange(k.shape[2] - x.shape[1], k.shape[2]).expand_as(position_ids)
        mask = (kpos[:, None, :] // C == qpos[:, :, None] // C) & (kpos[:, None, :] <= position_ids[:, :, None])
        mask &= attention_mask.bool()[:, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]), (k, v)


torch.manual_seed(0)
m = Chunked()
am = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
pos = (am.cumsum(-1) - 1).clamp(min=0)
_, past = m(torch.randn(2, 6, 8), am, pos)
for _ in range(3):
    am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
    pos = am.sum(-1, keepdim=True) - 1
    _, past = m(torch.randn(2, 1, 8), am, pos, past)
