"""A Flax-style decode cache kept in a dict, whose decode step hands SDPA no occupancy mask.

Written for maskcli's tests (not a published bug): the second program unwritten-slot catches through a cache kept as
Flax's 'cache' collection (`cached_key` / `cached_value` buffers of `max_length` slots, `cache_index` a 0-d tensor
counting the tokens written; the first: NVIDIA/TransformerEngine#119's inverted mask, tests/data/bugs). The prompt of
3 tokens is written in one call with a causal mask; each decode step writes its token at `cache_index` and calls SDPA
over all 8 slots with no mask, so it attends the zero slots past the ones written.
Fix (--fixed): the step's keep-mask `arange(max_length) < cache_index` (Flax linen's decode branch).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class DecoderSelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, cache):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)  # (b, n, heads, depth)
        start = int(cache["cache_index"])
        cache["cached_key"][:, start:start + n] = k
        cache["cached_value"][:, start:start + n] = v
        cache["cache_index"] = cache["cache_index"] + n
        slots = cache["cached_key"].shape[1]
        written = torch.arange(slots) < cache["cache_index"]
        at = torch.arange(start, start + n)
        mask = (torch.arange(slots)[None, :] <= at[:, None]) & written
        if n == 1 and not FIXED:
            mask = None  # the decode step: no mask, as if every slot were written
        out = F.scaled_dot_product_attention(q.transpose(1, 2), cache["cached_key"].transpose(1, 2),
                                             cache["cached_value"].transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    attn = DecoderSelfAttention().eval()
    cache = {"cached_key": torch.zeros(2, 8, 2, 8), "cached_value": torch.zeros(2, 8, 2, 8),
             "cache_index": torch.tensor(0)}
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        outs = [attn(x[:, :3], cache)] + [attn(x[:, t:t + 1], cache) for t in range(3, 6)]
    print("fixed" if FIXED else "buggy", f"{torch.cat(outs, 1).sum().item():.4f}")


if __name__ == "__main__":
    main()
