# A chunked prefill over a cache that keeps every key, written as hand-written research code does it: eager softmax,
# an additive mask, a left-padded batch of two. The layer has a sliding window of 3 (its prompt pass lays it); for
# every chunk after the first the buggy path builds the window over the chunk's own positions and hands the kernel
# only the chunk's keys (`k[:, :, -n:]`, as if the earlier keys were out of every window), so the chunk's first
# queries lose the cached keys inside their window. --fixed hands every cached key under the window placed at the
# chunk's offset.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
NEG = torch.finfo(torch.float32).min


def window_bias(n, offset, window, pad):
    """(b, 1, n, offset + n) additive bias: causal, within `window` keys, padding keys masked."""
    q = torch.arange(offset, offset + n)[:, None]
    k = torch.arange(offset + n)[None, :]
    keep = (k <= q) & (k > q - window)
    keep = keep[None] & ~pad[:, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, NEG)[:, None]


class Block(nn.Module):
    def __init__(self, dim=16, heads=2, window=3):
        super().__init__()
        self.heads, self.hd, self.window = heads, dim // heads, window
        self.wq, self.wk, self.wv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_cache = self.v_cache = None

    def split(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.hd).transpose(1, 2)

    def forward(self, x, pad):
        n = x.shape[1]
        offset = 0 if self.k_cache is None else self.k_cache.shape[2]
        q, k, v = self.split(self.wq(x)), self.split(self.wk(x)), self.split(self.wv(x))
        self.k_cache = k if self.k_cache is None else torch.cat([self.k_cache, k], dim=2)
        self.v_cache = v if self.v_cache is None else torch.cat([self.v_cache, v], dim=2)
        keys, values = self.k_cache, self.v_cache
        if offset and not FIXED:
            bias = window_bias(n, 0, self.window, pad[:, offset:])  # the chunk's own positions only
            keys, values = keys[:, :, -n:], values[:, :, -n:]
        else:
            bias = window_bias(n, offset, self.window, pad)
        scores = q @ keys.transpose(-1, -2) / self.hd ** 0.5 + bias
        return (torch.softmax(scores, dim=-1) @ values).transpose(1, 2).reshape(x.shape)


def main():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 10, 16)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, :2] = True  # row 1 left-padded by two tokens
    with torch.no_grad():
        block(x[:, :6], pad[:, :6])
        out = block(x[:, 6:], pad)
    print(f"fixed={FIXED} chunk 2 output norm {out.norm():.4f}")


if __name__ == "__main__":
    main()
