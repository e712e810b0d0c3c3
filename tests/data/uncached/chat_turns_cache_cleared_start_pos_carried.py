"""A chat loop that feeds every token one at a time at `start_pos`, its cache cleared between turns (the bug).

A hand-written decoder in Meta's llama style: `forward(tokens, start_pos)` writes the step's keys into its cache at
start_pos and attends over the cache's first start_pos + 1 rows; RoPE rotates at start_pos. The chat feeds the first
turn token by token, then the second turn, carrying start_pos on. The buggy loop makes a new, empty cache for the
second turn (and attends its rows from the turn's first token, as many as were written since), so the second turn's
first token, at position 6, attends only itself. --fixed keeps the cache. Self-check of the fix: the last token's
logits match one pass over the whole conversation.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, H, V, MAX = 16, 2, 30, 32
emb, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
inv = 1.0 / 10000 ** (torch.arange(0, D // H, 2) / (D // H))


def rope(x, start_pos):
    ang = (start_pos + torch.arange(x.shape[2]))[None, None, :, None].float() * inv
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1).flatten(-2)


def heads(x):
    return x.view(1, x.shape[1], H, D // H).transpose(1, 2)


class Cache:
    def __init__(self, first=0):
        self.k, self.v, self.first = torch.zeros(1, H, MAX, D // H), torch.zeros(1, H, MAX, D // H), first


def forward(tokens, start_pos, cache):
    x = emb(tokens)
    q, k, v = rope(heads(wq(x)), start_pos), rope(heads(wk(x)), start_pos), heads(wv(x))
    n = tokens.shape[1]
    cache.k[:, :, start_pos:start_pos + n], cache.v[:, :, start_pos:start_pos + n] = k, v
    keys, values = cache.k[:, :, cache.first:start_pos + n], cache.v[:, :, cache.first:start_pos + n]
    mask = torch.ones(n, keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - n)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return head(x + out.transpose(1, 2).reshape(1, n, D))


with torch.no_grad():
    turns = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    cache, start_pos = Cache(), 0
    for t, turn in enumerate(turns):
        if t and not FIXED:
            cache = Cache(first=start_pos)  # (a new, empty cache for the turn; start_pos carried on)
        for token in turn:
            logits = forward(torch.tensor([[token]]), start_pos, cache)
            start_pos += 1
    whole = sum(turns, [])
    want = forward(torch.tensor([whole]), 0, Cache())[0, -1]
print("last logits match one pass:", torch.allclose(logits[0, -1], want, atol=1e-5))
