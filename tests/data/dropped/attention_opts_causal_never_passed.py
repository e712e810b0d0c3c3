"""A small autoregressive music-token model written in a research repo's functional style: the main module keeps
`attention_opts = {"causal": True, "dropout": 0.0}` (what every block's attention should be given), and the blocks call
a functional `attention(q, k, v, causal=False)` through torch.matmul and a softmax. The buggy blocks call it without
the options, so no call ever masks (a batch of two equal-length sequences); the fixed ones pass `**attention_opts`,
and the same function builds its upper-triangle fill."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

attention_opts = {"causal": True, "dropout": 0.0}


def attention(q, k, v, causal=False, dropout=0.0):
    scores = torch.matmul(q, k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    if causal:
        n = scores.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(upper, -1e4)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(nn.functional.dropout(weights, dropout), v)


class Block(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.to_q(x)), self.split(self.to_k(x)), self.split(self.to_v(x))
        y = attention(q, k, v, **attention_opts) if FIXED else attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.ff(x)


class MusicLM(nn.Module):
    def __init__(self, vocab=32, dim=24, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


model = MusicLM().eval()
tokens = torch.randint(0, 32, (2, 9))
with torch.no_grad():
    logits = model(tokens)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32
    leak = (model(changed)[:, 0] - logits[:, 0]).abs().max().item()
print(f"fixed={FIXED} change of position 0's logits when only the last token changes: {leak:.3e}")
