"""A sliding-window cache that trims to W - chunk keys before a multi-token chunk, then the mask trims again.

Bug: `SlidingCache.append` keeps only the last `window - len(chunk)` cached keys before it concatenates a chunk, as if
the whole chunk had to fit inside one window; the chunk's first query then sees window - chunk + 1 keys instead of
the window. The program prefills a prompt, appends a second chunk of 5 tokens behind the cache, and checks the
chunk's logits against one pass over the whole sequence with the same window (window 6, a batch of two). Fix: keep the
last `window - 1` keys, the most any new query's window reaches back. einsum scores, masked_fill, a softmax; the
model is called with `input_ids`.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
WINDOW = 6


class SlidingCache:
    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        if self.k is not None:
            keep = WINDOW - 1 if FIXED else WINDOW - k.shape[2]
            self.k = torch.cat([self.k[:, :, -keep:], k], 2)
            self.v = torch.cat([self.v[:, :, -keep:], v], 2)
        else:
            self.k, self.v = k, v
        return self.k, self.v


class Layer(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if cache is not None:
            k, v = cache.append(k, v)
        s = k.shape[2]
        rel = torch.arange(s - t, s)[:, None] - torch.arange(s)[None, :]  # queries are the last t keys
        keep = (rel >= 0) & (rel < WINDOW)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k).masked_fill(~keep, float("-inf"))
        return x + torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).transpose(1, 2).reshape(b, t, d)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, input_ids, caches=None):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, None if caches is None else caches[i])
        return h


def main():
    torch.manual_seed(0)
    model = Model().eval()
    ids = torch.randint(0, 40, (2, 14))
    with torch.no_grad():
        caches = [SlidingCache() for _ in model.layers]
        model(ids[:, :9], caches)
        chunk = model(ids[:, 9:], caches)
        whole = model(ids)[:, 9:]
    print("max |chunk - one pass| = %.5f" % (chunk - whole).abs().max().item())


if __name__ == "__main__":
    main()
