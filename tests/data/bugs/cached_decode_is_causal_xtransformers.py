"""lucidrains/x-transformers#187 (1.): with a cache, attention kept calling F.scaled_dot_product_attention(...,
is_causal=causal) for the one new query, which PyTorch aligns top-left (FlashAttention 2.0's convention), so the
cached keys were masked out. The suggested fix: is_causal = causal and q.shape[2] >= k.shape[2]."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attend(nn.Module):
    def __init__(self, causal=True):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        is_causal = self.causal and q.shape[2] >= k.shape[2] if FIXED else self.causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


class Attention(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.attend = Attend()

    def forward(self, x, cache=None):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        return self.attend(q, k, v).transpose(1, 2).reshape(b, n, d), (k, v)


torch.manual_seed(0)
attn = Attention().eval()
x = torch.randn(1, 4, 8)
with torch.no_grad():
    out, cache = attn(x)
    for _ in range(2):
        out, cache = attn(out[:, -1:], cache)
