"""A decoder whose `pad_mask` is True on the tokens (Keras's and Flax's way round, not torch's), left padded.

The block ANDs its `pad_mask` with a causal mask and fills the scores where the result is False, in an eager
softmax: every real query sees its own and earlier real tokens, no padding. torch reads a `pad_mask` as True =
padding; here the mask keeps to the other reading exactly, so nothing the program states is contradicted.
With `--query-side` the block lays pad_mask along the queries instead of the keys: the padding rows see nothing
and the real queries see the left pads before them, which neither reading of `pad_mask` allows.
Then one decode step over a cache of 9 slots, 7 written: its `pad_mask` is True on slots 0 .. 7 (the tokens so far),
the query at slot 7 sees them all (SDPA, a bool mask).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

QUERY_SIDE = "--query-side" in sys.argv


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, pad_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None]
        allowed = allowed & (pad_mask[:, :, None] if QUERY_SIDE else pad_mask[:, None, :])
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return x + (weights @ v).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([7, 4, 5])
    pad_mask = torch.arange(7)[None, :] >= 7 - lengths[:, None]  # True on each row's tokens, padded on the left
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        out = Block(16, 2).eval()(x, pad_mask)
        print(out[:, -1, :3])
        step = DecodeStep()(torch.randn(3, 9, 16), torch.arange(9)[None, :].expand(3, -1) <= 7, cache_update_index=7)
        print(step[:, 0, :3])


class DecodeStep(nn.Module):
    def forward(self, cache, pad_mask, cache_update_index):
        """One query at slot `cache_update_index` over the cache's slots; `pad_mask` True on the slots written so far."""
        at = cache_update_index
        q = cache[:, None, at:at + 1]
        allowed = (torch.arange(cache.shape[1]) <= at)[None, None, None, :] & pad_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, cache[:, None], cache[:, None], attn_mask=allowed)[:, 0]


if __name__ == "__main__":
    main()
