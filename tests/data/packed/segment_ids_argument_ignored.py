"""Two packed rows handed with their segment ids (MaxText's convention: 0 = padding, 1, 2, ... each packed sample),
which the attention ignores.

Bug: the model takes `segment_ids` beside the token ids but its attention runs SDPA with `is_causal=True` alone, so
each packed sample attends to the samples packed before it in its row. Fix: a boolean mask keeps each query to the
earlier keys of its own segment (padding, segment 0, sees only padding).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, h, allowed):
        b, t, w = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if allowed is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return h + out.transpose(1, 2).reshape(b, t, w)


class PackedLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([Layer(width, heads), Layer(width, heads)])

    def forward(self, input_ids, segment_ids):
        allowed = None
        if FIXED:
            t = input_ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            allowed = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, allowed)
        return h


torch.manual_seed(0)
ids = torch.randint(1, 32, (2, 9))
segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3],
                         [1, 1, 1, 1, 1, 2, 2, 0, 0]])
with torch.no_grad():
    print("out", round(float(PackedLM()(ids, segments)[0, 4, 0]), 4))
