"""A layer whose prefill runs through a child module (its own banded mask, window 3) and whose decode steps attend in
the layer itself over the cache: the buggy decode applies the batch's left padding but not the window; `--fixed`
applies both. Written as a second form of goombalab/hnet#20 (window kept by the prefill kernel only), differently:
separate q, k, v (no packed kv), an additive float mask, a left-padded batch of two."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
WINDOW = 3  # keys back from each query, its own excluded


def banded(q_pos, k_len, real):
    """Additive (B, 1, Lq, Lk): key k visible to the query at p iff real, k <= p and p - k <= WINDOW; a padding query sees every key."""
    k = torch.arange(k_len)[None, :]
    keep = (k <= q_pos[:, None]) & (q_pos[:, None] - k <= WINDOW)
    keep = keep[None, None] & real[:, None, None, :]
    padding_query = ~real[:, q_pos][:, None, :, None]
    keep = keep | padding_query  # (a padding query sees every key, as transformers unmasks such rows for SDPA)
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


class LocalAttention(nn.Module):
    def forward(self, q, k, v, real):
        mask = banded(torch.arange(q.shape[2]), k.shape[2], real)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Layer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.proj = heads, nn.Linear(d, 3 * d)
        self.local = LocalAttention()
        self.k_cache = self.v_cache = None

    def forward(self, x, real):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.proj(x).chunk(3, dim=-1))
        if self.k_cache is None:
            self.k_cache, self.v_cache = k, v
            out = self.local(q, k, v, real)
        else:
            self.k_cache, self.v_cache = torch.cat([self.k_cache, k], 2), torch.cat([self.v_cache, v], 2)
            length = self.k_cache.shape[2]
            if FIXED:
                mask = banded(torch.tensor([length - 1]), length, real)
            else:
                mask = torch.zeros(b, 1, 1, length).masked_fill(~real[:, None, None, :], float("-inf"))
            out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, d)


torch.manual_seed(0)
layers = nn.ModuleList(Layer() for _ in range(2))
x = torch.randn(2, 6, 16)
real = torch.tensor([[False, False, True, True, True, True], [True] * 6])  # row 0 left-padded by 2
with torch.no_grad():
    h = x
    for layer in layers:
        h = layer(h, real)
    for _ in range(3):
        real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], 1)
        h = torch.randn(2, 1, 16)
        for layer in layers:
            h = layer(h, real)
print("fixed" if FIXED else "buggy")
