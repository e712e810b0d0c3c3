"""A llama2.c-style model (precomputed `freqs_cos` / `freqs_sin` tables, interleaved rotary pairs) that reads a batch of
prompts at once and then decodes with a cache of its own, the keys concatenated step by step, SDPA causal over the
prompt. Bug: each decode step takes the tables' first rows (`freqs_cos[:seqlen]`), so the new token is rotated at
position 0 whatever the cache holds. Fixed: the rows at the step's position (`freqs_cos[pos:pos + seqlen]`)."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def tables(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.cos(angles), torch.sin(angles)


def rotate(x, freqs_cos, freqs_sin):
    x_r, x_i = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)
    c, s = freqs_cos[None, :, None, :], freqs_sin[None, :, None, :]
    return torch.stack([x_r * c - x_i * s, x_r * s + x_i * c], dim=-1).flatten(3)


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, freqs_cos, freqs_sin, cache):
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, freqs_cos, freqs_sin), rotate(k, freqs_cos, freqs_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        return x + self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Model(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2, max_len=64):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        freqs_cos, freqs_sin = tables(dim // 4, max_len)
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, tokens, pos, caches):
        seqlen = tokens.shape[1]
        if FIXED:
            freqs_cos, freqs_sin = self.freqs_cos[pos:pos + seqlen], self.freqs_sin[pos:pos + seqlen]
        else:
            freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        x = self.embed(tokens)
        for block, cache in zip(self.blocks, caches):
            x = block(x, freqs_cos, freqs_sin, cache)
        return self.head(x)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Model().eval()
    tokens = torch.randint(0, 50, (2, 6))
    caches = [[] for _ in model.blocks]
    logits = model(tokens, 0, caches)
    out = []
    for step in range(4):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, tokens.shape[1] + step, caches)
    print(torch.cat(out, dim=1).tolist(), logits[:, -1, :4].tolist())


if __name__ == "__main__":
    main()
