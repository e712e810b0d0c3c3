"""A decoder whose cache stores rotated keys; each step rotates the new keys at `past + arange(n)`, appends them, and
rotates the queries at positions taken from the cache's length *after* the append (`cache.length - n` read too late:
the buggy version reads `cache.length` instead), so every query sits n positions past its own key: in the prompt n is
the prompt's length, at each decode step one. The fix reads the length before the append. Written for
tests/test_checks_rotatedkeys.py (HF's (b, h, n, d) layout, rotate_half, SDPA)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, positions):
        freqs = positions[:, None].float() * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]


class Cache:
    def __init__(self):
        self.k = self.v = None

    @property
    def length(self):
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x, cache):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        past = cache.length
        cos, sin = self.rotary(past + torch.arange(n))
        k = k * cos + rotate_half(k) * sin
        k, v = cache.append(k, v)
        start = cache.length if not FIXED else past
        cos_q, sin_q = self.rotary(start + torch.arange(n))
        q = q * cos_q + rotate_half(q) * sin_q
        y = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class Decoder(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, caches):
        h = self.embed(ids)
        for layer, cache in zip(self.layers, caches):
            h = h + layer(h, cache)
        return self.head(h)


model = Decoder().eval()
ids = torch.randint(0, 50, (2, 6))
caches = [Cache() for _ in model.layers]
out = []
with torch.no_grad():
    logits = model(ids, caches)
    for _ in range(3):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, caches)
print("generated", torch.cat(out, 1).tolist())
