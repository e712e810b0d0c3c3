"""A hand-written decoder-only LM in the Annotated Transformer's style: a `PositionalEncoding` buffer of interleaved
sin/cos rows added to the embeddings, a KV cache per layer, greedy decoding. The buggy version adds
`pe[:, :x.size(1)]` at every step, so each generated token is embedded at position 0 while its key is appended after
the cached prompt; the fix (--fixed) adds the rows from the cache's length on. Written for
tests/test_checks_positioned.py."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x, start=0):
        return x + self.pe[:, start:start + x.size(1)]


class Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, cache):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
        cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, d))
        return x + self.ff(x)


class LM(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = PositionalEncoding(d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.d = d

    def forward(self, ids, caches):
        past = caches[0]["k"].shape[2] if caches[0] else 0
        x = self.embed(ids) * math.sqrt(self.d)
        x = self.pos(x, start=past if FIXED else 0)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return self.head(x)


model = LM().eval()
prompt = torch.randint(0, 40, (2, 6))
caches = [{} for _ in model.layers]
generated = []
with torch.no_grad():
    logits = model(prompt, caches)
    for _ in range(4):
        token = logits[:, -1:].argmax(-1)
        generated.append(token)
        logits = model(token, caches)
print(torch.cat(generated, 1).tolist())
