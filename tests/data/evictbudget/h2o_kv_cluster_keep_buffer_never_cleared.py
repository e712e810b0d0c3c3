"""A heavy-hitter (H2O) KV cache whose keep mask lives in a buffer reused across decode steps and never cleared.

The same slip as FMInference/H2O PR #34 (the next step's eviction mask a view of the one the scores' bookkeeping
then wrote into, and never zeroed in the heavy-only branch), written another way: a KVCache-Factory-style module
that states `hh_size` and `recent_size` as ints, a batch of two prompts (the second left-padded) under a bool
padding mask, a masked_fill with the dtype's lowest value before the softmax, and the keep mask written each step into a slice of one
preallocated buffer `self.keep_buf`: the slice is a view, so the heavy hitters and recent keys of every earlier step
stay set and each decode query sees more than hh_size + recent_size keys. The fix builds the keep mask fresh.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class H2OAttention(nn.Module):
    def __init__(self, dim=16, heads=2, hh_size=3, recent_size=3, max_len=32):
        super().__init__()
        self.heads, self.hh_size, self.recent_size, self.max_len = heads, hh_size, recent_size, max_len
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.keep_buf = None

    def forward(self, x, real, past=None):
        """real: (B, kv) True on the keys that are tokens (the caller's padding mask over the cache and x)."""
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        kv = k.shape[2]
        mask = real[:, None, None, :].expand(b, self.heads, t, kv)
        if past is None:
            mask = mask & torch.ones(t, kv, dtype=torch.bool).tril()
        else:
            mask = mask & self.keep[..., None, :kv]
        scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        weights = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)
        acc = weights.sum(2) if past is None else torch.cat([self.acc, weights.new_zeros(b, self.heads, 1)], -1) + weights.sum(2)
        self.acc = acc
        self.keep = self._next_keep(acc, real)
        return (weights @ v).transpose(1, 2).reshape(b, t, d), (k, v)

    def _next_keep(self, acc, real):
        """Keys kept for the next step: the hh_size heaviest outside the recent window, the recent window and the
        next token's own slot (recent_size keys in all with it)."""
        b, h, kv = acc.shape
        if FIXED:
            keep = torch.zeros(b, h, kv + 1, dtype=torch.bool)
        else:
            if self.keep_buf is None:
                self.keep_buf = torch.zeros(b, h, self.max_len, dtype=torch.bool)
            keep = self.keep_buf[..., :kv + 1]  # a view: what earlier steps kept is still there
        old = kv + 1 - self.recent_size
        keep[..., old:] = True
        heavy = acc[..., :old].masked_fill(~real[:, None, :old], float("-inf")).topk(self.hh_size, dim=-1).indices
        keep.scatter_(-1, heavy, True)
        return keep


attn = H2OAttention().eval()
lengths, width, steps = [12, 9], 12, 6
real = torch.tensor([[i >= width - n for i in range(width)] for n in lengths])
x = torch.randn(2, width + steps, 16)
with torch.no_grad():
    _, past = attn(x[:, :width], real)
    for s in range(steps):
        real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], 1)
        _, past = attn(x[:, width + s:width + s + 1], real, past)
print(f"keys kept at the last step per head (budget {attn.hh_size + attn.recent_size}): "
      f"{attn.keep.sum(-1).max().item()}")
