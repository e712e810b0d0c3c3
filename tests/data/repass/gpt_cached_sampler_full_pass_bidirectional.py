"""A nanoGPT-style model with a KV cache, its cached sampler checked against the full forward (written another way
than torch-to-nnef#217: a hand-written softmax, a batch of two, the cache a list the block keeps).

Bug: the full forward builds its causal mask only `if self.cache is not None` (the mask was meant for the cached
path alone), so the uncached pass over the prompt is bidirectional; the cached pass, fed the same tokens one at a
time from an empty cache, sees only the past, and the two disagree. Fix: the causal mask on every pass of several
queries.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, n_embd=32, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.cache = None

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.cache is not None:
            if self.cache[0] is not None:
                k = torch.cat([self.cache[0], k], 2)
                v = torch.cat([self.cache[1], v], 2)
            self.cache = (k, v)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if T > 1 and (FIXED or self.cache is not None):
            S = k.size(2)
            future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
            att = att.masked_fill(future, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT(nn.Module):
    def __init__(self, vocab=50, n_embd=32, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.h = nn.ModuleList(Block(n_embd) for _ in range(n_layer))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)

    def use_cache(self, on):
        for block in self.h:
            block.cache = (None, None) if on else None


def main():
    model = GPT().eval()
    idx = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        full = model(idx)
        model.use_cache(True)
        cached = torch.cat([model(idx[:, t : t + 1]) for t in range(idx.shape[1])], 1)
        model.use_cache(False)
    print(f"full pass vs cached steps, max |logit diff| = {(full - cached).abs().max():.4f}")


if __name__ == "__main__":
    main()
