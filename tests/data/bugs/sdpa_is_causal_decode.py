"""pytorch/pytorch#144858 (and #103082): generating with a KV cache, each step's one new query went to
scaled_dot_product_attention with is_causal=True, which aligns the causal mask top-left: the query sees key 0 only,
and generation repeats the same token. The fix passes the bottom rows of the square causal mask,
torch.tril(torch.ones(w, w, dtype=torch.bool))[-h:, :] (w keys, h queries)."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
heads, dim = 2, 8
wq, wk, wv = (torch.randn(dim, dim) for _ in range(3))
cache_k = cache_v = None
x = torch.randn(1, 5, dim)
for step in range(3):
    tokens = x if step == 0 else x[:, -1:]
    q, k, v = (torch.einsum("btd,de->bte", tokens, w).view(1, -1, heads, dim // heads).transpose(1, 2) for w in (wq, wk, wv))
    cache_k = k if cache_k is None else torch.cat([cache_k, k], dim=2)
    cache_v = v if cache_v is None else torch.cat([cache_v, v], dim=2)
    h, w = q.shape[2], cache_k.shape[2]
    if FIXED:
        mask = torch.tril(torch.ones(w, w, dtype=torch.bool))[-h:, :]
        out = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
    else:
        out = F.scaled_dot_product_attention(q, cache_k, cache_v, is_causal=True)
    x = torch.cat([x, out.transpose(1, 2).reshape(1, h, dim)[:, -1:]], dim=1)
