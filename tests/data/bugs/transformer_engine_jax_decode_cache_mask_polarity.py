"""TransformerEngine/JAX MultiHeadAttention (decode=True): cache-occupancy mask inverted.

Citation: NVIDIA/TransformerEngine PR #119 "Fix Bugs of TE/JAX" (merged 2023-03-27,
label v0.7.0; "2. Fixed wrong masking issues in MultiHeadAttention when `decoded=True`";
"a hotfix for T5X model training"). The review hunk of transformer_engine/jax/
transformer.py was read:
    -    mask, jnp.broadcast_to(jnp.arange(length) <= cur_index, (batch, 1, 1, length)))
    +    mask, jnp.broadcast_to(jnp.arange(length) > cur_index, (batch, 1, 1, length)))
TE/JAX masks are "True = mask out" (NVIDIA/TransformerEngine#818 review: "`mask_bit =
True` means mask out"), unlike Flax linen (True = keep), whose decode branch writes the
same `arange(max_length) <= cur_index` expression as a keep-mask.

Bug: during incremental decoding the step's mask marked the cache slots already written
(`arange(length) <= cur_index`, Flax's keep-mask expression) and, under TE's mask-out
convention, hid exactly those slots: each new token attended only to the empty,
zero-filled slots after it and never to itself or the past.
Fix: `jnp.arange(length) > cur_index` -- mask out the slots not yet written.

Reproduction: a torch port of the decode branch (a `cache` dict standing in for Flax's
'cache' collection: cached_key, cached_value, cache_index; one-hot scatter of the new
key/value; `combine_masks`; softmax with `masked_fill(mask, -1e10)` as TE's
SCALED_MASKED softmax does), batch 2, cache length 6, four decode steps, compared with
full causal attention over the same tokens. The layout fixes of the same PR
(transpose_batch_sequence, moveaxis) are left out; only the mask line differs.
"""
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def combine_masks(*masks: Optional[torch.Tensor]):
    """Combine mask-out masks (True = masked) by logical OR; None entries are ignored."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    mask, *other_masks = masks
    for other_mask in other_masks:
        mask = torch.logical_or(mask, other_mask)
    return mask


class MultiHeadAttention(nn.Module):
    def __init__(self, head_dim=8, num_heads=4, hidden=32):
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * num_heads * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def core_attention(self, query, key, value, mask):
        # (batch, seq, heads, dim) layout, as TE/JAX's BSHD
        logits = torch.einsum("bqhd,bkhd->bhqk", query, key) / self.head_dim ** 0.5
        if mask is not None:
            logits = logits.masked_fill(mask, -1e10)  # True = mask out
        weights = F.softmax(logits, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", weights, value)

    def forward(self, inputs_q, mask=None, decode=False, cache=None):
        batch = inputs_q.shape[0]
        q, key, value = self.qkv(inputs_q).view(batch, -1, 3, self.num_heads, self.head_dim).unbind(2)

        if decode:
            is_initialized = "cached_key" in cache
            if not is_initialized:
                length = cache["max_length"]
                cache["cached_key"] = torch.zeros(batch, length, self.num_heads, self.head_dim)
                cache["cached_value"] = torch.zeros(batch, length, self.num_heads, self.head_dim)
                cache["cache_index"] = 0
            batch, length, num_heads, head_dim = cache["cached_key"].shape
            cur_index = cache["cache_index"]
            one_hot_indices = F.one_hot(torch.tensor(cur_index), length).to(key.dtype)
            one_hot_indices = one_hot_indices.reshape(1, length, 1, 1)
            key = cache["cached_key"] + key * one_hot_indices
            value = cache["cached_value"] + value * one_hot_indices
            cache["cached_key"] = key
            cache["cached_value"] = value
            cache["cache_index"] = cur_index + 1

            if FIXED:
                step_mask = torch.arange(length) > cur_index
            else:
                step_mask = torch.arange(length) <= cur_index
            mask = combine_masks(mask, step_mask.broadcast_to(batch, 1, 1, length))

        x = self.core_attention(q, key, value, mask)
        return self.out(x.reshape(batch, -1, self.num_heads * self.head_dim))


def main():
    torch.manual_seed(0)
    attn = MultiHeadAttention().eval()
    x = torch.randn(2, 4, 32)
    cache = {"max_length": 6}
    with torch.no_grad():
        steps = [attn(x[:, t:t + 1], decode=True, cache=cache) for t in range(4)]
        decoded = torch.cat(steps, dim=1)
        causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)  # True = mask out
        full = attn(x, mask=causal[None, None])
    diff = (decoded - full).abs().max().item()
    print("fixed" if FIXED else "buggy", "decode vs full causal max diff:", f"{diff:.2e}")


if __name__ == "__main__":
    main()
