"""onnx/onnx#8068 (and Dao-AILab/flash-attention#282 for flash-attn 2.0): is_causal is aligned top-left, correct only
when the query block is the whole sequence; for chunked (continued) prefill against a KV cache the new queries sit at
the end of the keys, and top-left alignment masks out valid past keys and lets queries attend future positions. The
fix aligns the causal frontier bottom-right (offset by the cached length)."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
tokens = torch.randn(1, 2, 12, 8)
cache_k = cache_v = tokens[:, :, :0]
for start in range(0, 12, 4):  # prefill in chunks of 4 against the cache
    chunk = tokens[:, :, start:start + 4]
    cache_k = cache_v = torch.cat([cache_k, chunk], dim=2)
    q_len, k_len = chunk.shape[2], cache_k.shape[2]
    if FIXED:
        offset = k_len - q_len
        frontier = torch.arange(k_len)[None, :] <= torch.arange(offset, k_len)[:, None]
        out = F.scaled_dot_product_attention(chunk, cache_k, cache_v, attn_mask=frontier)
    else:
        out = F.scaled_dot_product_attention(chunk, cache_k, cache_v, is_causal=True)
