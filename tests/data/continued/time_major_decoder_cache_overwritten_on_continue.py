# The TabPFN bug (PriorLabs/TabPFN#852: a call meant to read the cached K/V of the call before it wrote its own
# instead) written another way: a time-major (seq, batch, dim) causal decoder of its own with a module-held K/V cache,
# run once over 9 steps and again as 6 steps then 3 more; the continuation stores its fresh K/V over the cache instead
# of appending to it, so the last 3 steps see only themselves. SDPA with a boolean mask laid bottom-right.
# --fixed: the continuation concatenates the cached K/V before its own.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CachedSelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cache = None

    def forward(self, x, use_cache):  # x: (seq, batch, dim)
        seq, batch, dim = x.shape
        q, k, v = (t.view(seq, batch, self.heads, -1).permute(1, 2, 0, 3) for t in self.qkv(x).chunk(3, -1))
        if use_cache and self.cache is not None and FIXED:
            k, v = torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2)
        if use_cache:
            self.cache = (k, v)
        keys = k.shape[2]
        mask = torch.ones(seq, keys, dtype=torch.bool).tril(keys - seq)  # bottom-right causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.permute(2, 0, 1, 3).reshape(seq, batch, dim))


class Decoder(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(CachedSelfAttention(dim) for _ in range(depth))

    def forward(self, steps, use_cache=False):
        for layer in self.layers:
            steps = layer(steps, use_cache)
        return steps

    def reset(self):
        for layer in self.layers:
            layer.cache = None


model = Decoder().eval()
series = torch.randn(9, 2, 16)
with torch.no_grad():
    whole = model(series)
    model(series[:6], use_cache=True)
    tail = model(series[6:], use_cache=True)
    model.reset()
print(f"|one pass - continued| over the last 3 steps: {(whole[6:] - tail).abs().max().item():.3e}")
