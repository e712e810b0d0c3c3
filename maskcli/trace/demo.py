"""A tiny decoder to trace: `maskcli trace -m maskcli.trace.demo`. Random weights, no download.

Two layers of SDPA attention over a sliding window, a batch of two prompts with left
padding, a prefill and then decode steps with a KV cache; it prints the token ids it
picks. Its masks are built the way decoders build them (bottom-right, the padding cut),
so a trace of it reads `window(W)` with the padding, step by step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask, cache):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask, cache):
        x = x + self.self_attn(self.norm(x), mask, cache)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, mask, caches):
        x = self.embed(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, mask, cache)
        return self.head(x)


def window_mask(real: torch.Tensor, queries: int, window: int) -> torch.Tensor:
    """Bool (B, 1, queries, keys), True = attend: the queries are the last positions; each sees itself and the
    window - 1 keys before it, and no padding key."""
    keys = real.shape[1]
    q = torch.arange(keys - queries, keys)[:, None]
    k = torch.arange(keys)[None, :]
    near = (k <= q) & (q - k < window)
    return near[None, None] & real[:, None, None, :]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--len", type=int, default=6, help="prompt length (the second prompt is 2 shorter, left padded)")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="decode steps after the prefill")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Decoder(layers=args.layers).eval()
    ids = torch.randint(1, 50, (2, args.len))
    ids[1, :2] = 0  # left padding
    real = ids != 0
    caches = [[] for _ in model.layers]
    picked = []
    with torch.no_grad():
        logits = model(ids, window_mask(real, args.len, args.window), caches)
        for _ in range(args.steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            picked.append(token)
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)], dim=1)
            logits = model(token, window_mask(real, 1, args.window), caches)
    print("picked:", torch.cat(picked, dim=1).tolist() if picked else [])


if __name__ == "__main__":
    main()
