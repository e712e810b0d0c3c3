# x-transformers (lucidrains/x-transformers commit d1f5d6b, "fix a long-standing bug with sparse topk feature"):
# Attend.forward builds sparse_topk_mask = sim < kth_top_value (True for the NON-top entries) and uses it as a keep-mask,
# so the top-k keys are dropped instead of kept; the top-k is also taken before the causal mask, over future keys.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class Attend(nn.Module):
    def __init__(self, *, causal=False, scale=None, sparse_topk=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        softmax_fn = partial(F.softmax, dim=-1)
        self.attn_fn = partial(softmax_fn, dtype=torch.float64)
        self.sparse_topk = sparse_topk

    def forward(self, q, k, v, mask=None, attn_bias=None):
        n = q.shape[-2]
        device = q.device
        scale = default(self.scale, q.shape[-1] ** -0.5)
        causal = self.causal
        if n == 1 and causal:
            causal = False

        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        sim = sim * scale

        if exists(attn_bias):
            sim = sim + attn_bias

        i, j, dtype = *sim.shape[-2:], sim.dtype
        mask_value = -torch.finfo(sim.dtype).max

        if not FIXED:
            if exists(self.sparse_topk) and self.sparse_topk < j:
                top_values, _ = sim.topk(self.sparse_topk, dim=-1)
                sparse_topk_mask = sim < top_values[..., -1:]
                mask = (mask & sparse_topk_mask) if exists(mask) else sparse_topk_mask

        if exists(mask):
            sim = sim.masked_fill(~mask, mask_value)

        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)

        if FIXED:
            if exists(self.sparse_topk):
                top_values, _ = sim.topk(self.sparse_topk, dim=-1)
                sparse_topk_mask = (sim >= top_values[..., -1:]) & (sim > mask_value)
                sim = sim.masked_fill(~sparse_topk_mask, mask_value)

        attn = self.attn_fn(sim)
        attn = attn.type(dtype)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        return out


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False, sparse_topk=None):
        super().__init__()
        self.heads = heads
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(causal=causal, sparse_topk=sparse_topk)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def qkv(self, x):
        b, n, _ = x.shape
        return tuple(t(x).view(b, n, self.heads, -1).transpose(1, 2) for t in (self.to_q, self.to_k, self.to_v))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        out = self.attend(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


TOPK = 4
attn = Attention(dim=32, heads=4, causal=True, sparse_topk=TOPK).eval()
x = torch.randn(2, 16, 32)

with torch.no_grad():
    out = attn(x)

    # reference: for every query, softmax over its TOPK highest-scoring causal (past or self) keys, one row at a time
    q, k, v = attn.qkv(x)
    ref = torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5
    for bi in range(q.shape[0]):
        for hi in range(q.shape[1]):
            for qi in range(q.shape[2]):
                s = (k[bi, hi, :qi + 1] @ q[bi, hi, qi]) * scale
                top = s.topk(min(TOPK, qi + 1)).indices
                w = torch.softmax(s[top], dim=-1)
                ref[bi, hi, qi] = w @ v[bi, hi, top]
    ref = attn.to_out(ref.transpose(1, 2).reshape(2, 16, -1))

    x2 = x.clone()
    x2[:, 8:] = torch.randn(2, 8, 32)
    leak = (attn(x2)[:, :8] - out[:, :8]).abs().max().item()

print(f"max |Attention(sparse_topk={TOPK}) - per-row causal top-{TOPK} reference|: {(out - ref).abs().max().item():.3e}")
print(f"max change of outputs[:8] when only inputs 8.. change: {leak:.3e}")
