"""Flax NNX MultiHeadAttention: `is_causal=True` during cached decode attends only to key 0.

Citation: google/flax#5591 ("NNX MultiHeadAttention: is_causal=True during decode attends only
to key position 0"), fix proposed in google/flax PR #5592 (open when read; `--fixed` applies
its change).  The issue and PR descriptions were read, not the diff; this is a torch port of
the JAX code path they describe (`nnx.MultiHeadAttention.__call__` with `decode=True`,
cache variables `cached_key` / `cached_value` / `cache_index`, and `dot_product_attention`).

Bug: in decode mode the module writes the new key/value at `cache_index` into a cache of
`max_length` slots and installs the cache-occupancy mask `arange(max_length) <= cur_index`.
It still forwarded `is_causal` to the attention function, which overlays
`tril(ones((T, S)))`; with T=1 and S=max_length that keeps only column 0, so every generated
token after the first attends to key position 0 only.
Fix (PR #5592): pass `is_causal=is_causal and not decode` — decode is already causal through
the occupancy mask.

Reproduction: the MiniGPT-style usage from the issue — the same `is_causal=True` flag used in
training kept while stepping `decode=True` one token at a time over a cache of max_length=6.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def combine_masks(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    mask = masks[0]
    for other in masks[1:]:
        mask = torch.logical_and(mask, other)
    return mask


def dot_product_attention(query, key, value, mask=None, is_causal=False):
    """query [B, T, H, D], key/value [B, S, H, D]; mask broadcastable to [B, H, T, S]."""
    depth = query.shape[-1]
    query = query / depth ** 0.5
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    if is_causal:
        t, s = attn_weights.shape[-2:]
        causal = torch.tril(torch.ones((t, s), dtype=torch.bool))
        mask = combine_masks(mask, causal)
    if mask is not None:
        big_neg = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(mask, attn_weights, big_neg)
    attn_weights = attn_weights.softmax(-1)
    return torch.einsum("...hqk,...khd->...qhd", attn_weights, value)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, in_features, qkv_features, decode=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = qkv_features // num_heads
        self.query = nn.Linear(in_features, qkv_features)
        self.key = nn.Linear(in_features, qkv_features)
        self.value = nn.Linear(in_features, qkv_features)
        self.out = nn.Linear(qkv_features, in_features)
        self.decode = decode
        self.cached_key = None

    def init_cache(self, input_shape):
        batch, max_length = input_shape[:2]
        shape = (batch, max_length, self.num_heads, self.head_dim)
        self.cached_key = torch.zeros(shape)
        self.cached_value = torch.zeros(shape)
        self.cache_index = 0

    def __call__(self, inputs_q, mask=None, is_causal=False, decode=None):
        decode = self.decode if decode is None else decode
        b, t, _ = inputs_q.shape
        split = (b, t, self.num_heads, self.head_dim)
        query = self.query(inputs_q).view(split)
        key = self.key(inputs_q).view(split)
        value = self.value(inputs_q).view(split)
        if decode:
            max_length = self.cached_key.shape[1]
            if t != 1:
                raise ValueError(f"Autoregressive cache shape error, expected query length 1, got {t}")
            cur_index = self.cache_index
            self.cached_key = self.cached_key.clone()
            self.cached_value = self.cached_value.clone()
            self.cached_key[:, cur_index] = key[:, 0]
            self.cached_value[:, cur_index] = value[:, 0]
            key, value = self.cached_key, self.cached_value
            self.cache_index = cur_index + 1
            # causal mask for cached decoder self-attention: attend to the filled slots only
            occupancy = (torch.arange(max_length) <= cur_index).view(1, 1, 1, max_length)
            mask = combine_masks(mask, occupancy.expand(b, self.num_heads, 1, max_length))
        attn_is_causal = (is_causal and not decode) if FIXED else is_causal
        x = dot_product_attention(query, key, value, mask=mask, is_causal=attn_is_causal)
        return self.out(x.reshape(b, t, -1))


def main():
    torch.manual_seed(0)
    max_length = 6
    mha = MultiHeadAttention(num_heads=2, in_features=4, qkv_features=4, decode=True)
    seq = torch.randn(1, max_length, 4)
    mha.init_cache(seq.shape)
    outs = []
    with torch.no_grad():
        for i in range(4):
            outs.append(mha(seq[:, i:i + 1], is_causal=True))
    last = torch.cat(outs, dim=1)[0, -1]
    print("decode step 3 out[:3] =", [round(x, 4) for x in last[:3].tolist()])


if __name__ == "__main__":
    main()
