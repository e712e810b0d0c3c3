"""A budgeted (H2O-style) cache that evicts inside its update, under a hand-written bottom-right causal mask.

Written as a BERT-style encoder stack names its modules (`attention.self`) with its own softmax: the mask is
`tril(ones(L, S), S - L)`, built from the lengths of what the cache returns, for a batch of 2 prompts of 10 tokens.
Buggy: the cache keeps 6 of the 10 new keys (the first 2 and the last 4) and returns only those, so queries 0-3 of
every row see no key at all. Fixed (--fixed): the cache returns every key of the call and evicts after it.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class BudgetCache:
    def __init__(self, budget=6, keep_first=2):
        self.budget, self.keep_first = budget, keep_first
        self.k = self.v = None

    def _trim(self, t):
        if t.shape[2] <= self.budget:
            return t
        return torch.cat([t[:, :, : self.keep_first], t[:, :, self.keep_first - self.budget:]], dim=2)

    def add(self, k, v):
        k = k if self.k is None else torch.cat([self.k, k], dim=2)
        v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.k, self.v = self._trim(k), self._trim(v)
        return (k, v) if FIXED else (self.k, self.v)


class SelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, cache):
        b, n, d = x.shape
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        k, v = cache.add(k, v)
        s = k.shape[2]
        keep = torch.tril(torch.ones(n, s, dtype=torch.bool), diagonal=s - n)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
        return (weights @ v).transpose(1, 2).reshape(b, n, d)


class Attention(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.self = SelfAttention(dim)
        self.output = nn.Linear(dim, dim)

    def forward(self, x, cache):
        return self.output(self.self(x, cache))


class Layer(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attention = Attention(dim)

    def forward(self, x, cache):
        return x + self.attention(x, cache)


class Decoder(nn.Module):
    def __init__(self, vocab=40, dim=16, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.ModuleList([Layer(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, caches):
        h = self.embed(input_ids)
        for layer, cache in zip(self.layer, caches):
            h = layer(h, cache)
        return self.head(h)


def main():
    torch.manual_seed(0)
    model = Decoder().eval()
    caches = [BudgetCache() for _ in model.layer]
    ids = torch.randint(1, 40, (2, 10))
    with torch.no_grad():
        logits = model(ids, caches)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(nxt, caches)
    print(f"{'fixed' if FIXED else 'buggy'} next {logits[:, -1].argmax(-1).tolist()}")


if __name__ == "__main__":
    main()
