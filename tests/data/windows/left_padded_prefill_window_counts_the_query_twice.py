# Written another way than eole#340 (prefill `triu_(-sliding_window)`, W + 1 keys, decode W keys): a hand-written
# sliding-window decoder (Mistral-style, a dynamic cache grown by torch.cat) over a left-padded batch of two prompts.
# Its prompt mask keeps `q - k <= window` (the query and `window` keys before it: W + 1), while each decode step keeps
# `q - k < window` (W keys, as the config's sliding_window means), both and-ed with the batch's padding. Fix: the
# prompt mask keeps `q - k < window` too.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Args:
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    vocab: int = 40


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.h = args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))

    def forward(self, x, keep, cache):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.h, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
        return x + self.wo(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, t, d))


class Transformer(nn.Module):
    def __init__(self, args, window=3):
        super().__init__()
        self.window = window
        self.tok = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))

    def forward(self, tokens, real, caches, start):
        t, s = tokens.shape[1], real.shape[1]
        q = torch.arange(start, start + t)[:, None]
        k = torch.arange(s)[None, :]
        if t > 1 and not FIXED:
            band = (k <= q) & (q - k <= self.window)
        else:
            band = (k <= q) & (q - k < self.window)
        keep = band[None, None] & real[:, None, None, :].bool()
        keep = keep | ~keep.any(-1, keepdim=True)  # (padding query rows see every key: no NaN)
        x = self.tok(tokens)
        for block, cache in zip(self.blocks, caches):
            x = block(x, keep, cache)
        return x


model = Transformer(Args()).eval()
prompts = [[5, 9, 14, 22, 7, 31, 3], [11, 4, 26, 8, 2]]
width = max(map(len, prompts))
tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
real = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
caches = [[] for _ in range(Args.n_layers)]
with torch.no_grad():
    x = model(tokens, real, caches, 0)
    for step in range(3):
        nxt = x[:, -1:, :4].argmax(-1) + 1
        real = torch.cat([real, torch.ones_like(nxt)], 1)
        x = model(nxt, real, caches, width + step)
print(f"{'fixed' if FIXED else 'buggy'}: decoded {x.shape}")
