"""An MLX-style port (plain classes with __call__, an `offset` handed to each layer) numbers decode steps from 0.

Written another way (skyzh/tiny-llm#65, tests/data/blind/tinyllm_kv_cache_decode_offset_restarts_inside_prompt.py):
the layers take `offset`, the position of the call's first token, rotate their queries and keys at
[offset, offset + L) and append the keys to the cache; the scores go through a softmax helper of the port's own, so
the function holding `offset` is three frames out from the softmax. The generation loop hands the prefill offset 0,
then each step the number of tokens generated so far, not the prompt's length plus those: the first generated token is
rotated at position 1, inside the prompt's positions 0..P-1 whose keys the cache holds. The fix hands
`len(prompt) + generated`.
"""

import math
import sys

import torch

FIXED = "--fixed" in sys.argv


def softmax(x, axis=-1):
    return torch.softmax(x, dim=axis)


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return softmax(scores) @ v


class RoPE:
    def __init__(self, dims, base=10000.0, max_len=256):
        inv = 1.0 / base ** (torch.arange(0, dims, 2).float() / dims)
        angles = torch.arange(max_len).float()[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()

    def __call__(self, x, offset):
        n = x.shape[-2]
        cos, sin = self.cos[offset:offset + n], self.sin[offset:offset + n]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class KVCache:
    def __init__(self):
        self.keys = self.values = None

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys, self.values = torch.cat([self.keys, k], dim=-2), torch.cat([self.values, v], dim=-2)
        return self.keys, self.values


class Attention:
    def __init__(self, dim=32, heads=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (torch.randn(dim, dim, generator=g) / math.sqrt(dim) for _ in range(4))
        self.rope = RoPE(self.head_dim)

    def __call__(self, x, offset, cache):
        b, n, d = x.shape
        q, k, v = ((x @ w).view(b, n, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q, offset), self.rope(k, offset)
        k, v = cache.update_and_fetch(k, v)
        mask = None
        if n > 1:
            mask = torch.full((n, n), float("-inf")).triu(1)
        out = attention(q, k, v, mask)
        return out.transpose(1, 2).reshape(b, n, d) @ self.wo


class Model:
    def __init__(self, vocab=40, dim=32, layers=2):
        g = torch.Generator().manual_seed(1)
        self.embed = torch.randn(vocab, dim, generator=g)
        self.layers = [Attention(dim, seed=i) for i in range(layers)]
        self.out = torch.randn(dim, vocab, generator=g) / math.sqrt(dim)

    def __call__(self, tokens, offset, caches):
        h = self.embed[tokens]
        for layer, cache in zip(self.layers, caches):
            h = h + layer(h, offset, cache)
        return h @ self.out


def generate(model, prompt, steps):
    caches = [KVCache() for _ in model.layers]
    logits = model(torch.tensor([prompt]), 0, caches)
    out = []
    for i in range(steps):
        token = int(logits[0, -1].argmax())
        out.append(token)
        offset = len(prompt) + i if FIXED else i + 1
        logits = model(torch.tensor([[token]]), offset, caches)
    return out


if __name__ == "__main__":
    print(generate(Model(), [3, 17, 8, 25, 11, 30, 2], 6))
