"""mlx-vlm BatchQuantizedKVCache.make_mask passes the per-sequence offset and drops left_padding.

Citation: Blaizzy/mlx-vlm#1208 ("Fix mask creation for batched quantized kv caches", commit 2a55b80,
2026-05-20), file mlx_vlm/models/cache.py:

    -    def make_mask(self, *args, **kwargs):
    -        from mlx_lm.models.cache import create_attention_mask
    -
    -        return create_attention_mask(*args, offset=self.offset, **kwargs)
    +    def make_mask(self, N: int, return_array: bool = False, **kwargs):
    +        from mlx_lm.models.cache import create_causal_mask
    +
    +        return create_causal_mask(
    +            N, offset=self._idx, left_padding=self.left_padding, **kwargs
    +        )

(the commit's test checks the mask equals BatchKVCache's for left_padding=[2, 0]; lablup/mlxcel#75 ports
the same fix and explains it: `offset` starts at -left_padding and is negative for padded sequences, the
mask must come from the number of buffered tokens and must exclude each sequence's left padding).

Bug: for continuous batching, prompts of different lengths are left-padded into one batch, and the
cache records left_padding. The quantized batch cache built its mask with mlx-lm's generic
create_attention_mask, which returns the string "causal" for a multi-token step and None for a
one-token step, so the padded key slots of the shorter prompt are attended at prefill and at every
decode step. Fix: create_causal_mask(N, offset=_idx, left_padding=left_padding).

Reproduction: a torch port of the cache (quantization of the stored keys/values omitted: it does not
touch the mask), mlx-lm's create_attention_mask / create_causal_mask, and a small attention layer that
asks the cache for its mask the way mlx-lm models do; a 5-token prefill of two prompts (3 and 5
tokens, left_padding=[2, 0]) then 2 decode steps.
"""
import sys
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def create_causal_mask(N: int, offset: int = 0, window_size=None, right_padding=None, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if right_padding is not None:
        mask = mask & (rinds < ((offset + N) - right_padding)[:, None, None, None])
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= rinds)
    return mask


def create_attention_mask(N: int, offset=0, return_array: bool = False, window_size=None):
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, offset, window_size=window_size)
    return "causal"


class BatchQuantizedKVCache:
    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-lp for lp in left_padding])
        self._idx = 0
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        num_steps = keys.shape[-2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        self.offset += num_steps
        self._idx += num_steps
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    if FIXED:
        def make_mask(self, N: int, return_array: bool = False, **kwargs):
            return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
    else:
        def make_mask(self, *args, **kwargs):
            return create_attention_mask(*args, offset=self.offset, **kwargs)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    if isinstance(mask, str):
        # mlx's "causal" string; the query block is the tail of the keys (here L == S at prefill)
        assert mask == "causal" and queries.shape[-2] == keys.shape[-2]
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class Attention(nn.Module):
    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def __call__(self, x, mask, cache):
        B, L, D = x.shape
        q, k, v = (p(x).view(B, L, self.n_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


def create_attention_mask_for_model(h, cache, return_array=False, window_size=None):
    # mlx_lm.models.base.create_attention_mask: the cache builds the mask
    return cache.make_mask(h.shape[1], return_array=return_array, window_size=window_size)


def main():
    torch.manual_seed(0)
    embed = nn.Embedding(64, 32)
    layer = Attention().eval()
    pad = 0
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    left_padding = [5 - len(p) for p in prompts]
    tokens = torch.tensor([[pad] * lp + p for lp, p in zip(left_padding, prompts)])
    cache = BatchQuantizedKVCache(left_padding)
    with torch.no_grad():
        h = embed(tokens)
        out = layer(h, create_attention_mask_for_model(h, cache), cache)
        for step in range(2):
            nxt = torch.tensor([[30 + step], [40 + step]])
            h = embed(nxt)
            out = layer(h, create_attention_mask_for_model(h, cache), cache)
    print("cache _idx", cache._idx, "out[0,-1,:3]", [round(v, 4) for v in out[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
