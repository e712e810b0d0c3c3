"""A minGPT-style decoder whose attention class is named `CausalAttention`, with a KV cache for sampling: the causal
mask is applied only `if self.training` (the cache path was added for sampling, where one query per step needs no
mask), so the eval-mode prompt pass attends both ways and writes that into the cache the sampling steps then read.
`--fixed` masks whenever a step has more than one query. Written as a second form of lag-llama#81 (a cached
first pass run non-causal), differently: token ids, einsum scores and a hand-written softmax, a growing cache,
a batch of two."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CausalAttention(nn.Module):
    def __init__(self, d_model=24, n_heads=3, block_size=16):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        self.cache = None

    def forward(self, x, use_cache=False):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if use_cache:
            if self.cache is not None:
                k = torch.cat([self.cache[0], k], dim=2)
                v = torch.cat([self.cache[1], v], dim=2)
            self.cache = (k, v)
        att = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(k.size(-1))
        if self.training or (FIXED and t > 1):
            past = k.size(2) - t
            att = att.masked_fill(self.tril[:, :, past:past + t, :k.size(2)] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = torch.einsum("bhij,bhjd->bhid", att, v)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(24), nn.LayerNorm(24)
        self.attn = CausalAttention()
        self.mlp = nn.Sequential(nn.Linear(24, 96), nn.GELU(), nn.Linear(96, 24))

    def forward(self, x, use_cache=False):
        x = x + self.attn(self.ln1(x), use_cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50, block_size=16):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, 24), nn.Embedding(block_size, 24)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(24, vocab)

    def forward(self, idx, start=0, use_cache=False):
        t = idx.size(1)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(start, start + t))
        for block in self.blocks:
            x = block(x, use_cache)
        return self.head(x)


@torch.no_grad()
def sample(model, idx, steps):
    logits = model(idx, 0, use_cache=True)
    for i in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        logits = model(nxt, idx.size(1) - 1, use_cache=True)
    return idx


torch.manual_seed(0)
model = GPT().eval()
prompt = torch.tensor([[4, 17, 9, 30, 2, 11], [8, 8, 41, 3, 19, 25]])
print("fixed" if FIXED else "buggy", sample(model, prompt, 3)[:, -3:].tolist())
