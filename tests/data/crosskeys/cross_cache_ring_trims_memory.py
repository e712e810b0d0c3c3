"""A decoder whose per-layer key/value cache trims to a local window, reused for the cross-attention's memory.

Three decoder layers; the middle one is a local layer (window 3) whose cache keeps its last 3 entries. The buggy
decoder caches the cross-attention's projected memory (7 encoder states) in the same kind of cache as its layer's
self-attention, so from the second step on the local layer cross-attends the last 3 memory states only. Scores by
matmul and softmax, a batch of 2. `--fixed`: the cross-attention cache keeps every memory state.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class KV:
    def __init__(self, keep=None):
        self.keep, self.k, self.v = keep, None, None

    def add(self, k, v):
        self.k = k if self.k is None else torch.cat((self.k, k), 1)
        self.v = v if self.v is None else torch.cat((self.v, v), 1)
        full = self.k, self.v
        if self.keep is not None:
            self.k, self.v = self.k[:, -self.keep:], self.v[:, -self.keep:]
        return full


class MemoryAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def forward(self, x, memory, cache):
        if cache.k is None:
            k, v = self.kv(memory).chunk(2, -1)
            k, v = cache.add(k, v)
        else:
            k, v = cache.k, cache.v
        weights = torch.softmax(self.q(x) @ k.transpose(1, 2) / x.shape[-1] ** 0.5, dim=-1)
        return weights @ v


class Layer(nn.Module):
    def __init__(self, dim, window):
        super().__init__()
        self.window = window
        self.src = MemoryAttention(dim)

    def forward(self, x, memory, cross_cache):
        return x + self.src(x, memory, cross_cache)


def main():
    torch.manual_seed(0)
    windows = [None, 3, None]
    layers = nn.ModuleList(Layer(8, w) for w in windows)
    memory = torch.randn(2, 7, 8)
    caches = [KV(None if FIXED else w) for w in windows]
    x = torch.randn(2, 1, 8)
    with torch.no_grad():
        for _ in range(3):
            for layer, cache in zip(layers, caches):
                x = layer(x, memory, cache)
    print(x[0, 0, :3])


if __name__ == "__main__":
    main()
