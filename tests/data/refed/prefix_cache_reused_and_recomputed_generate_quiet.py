# Correct programs of the shape cache-fed-again reads, that it must leave alone (both with and without --fixed):
# 1. a generate loop with no cache that hands the model the whole sequence at every step (keys = queries, recomputed);
# 2. prompt caching: a system prefix run once into a cache, then the same user turn run three times (three samples),
#    each over a fresh copy of the prefix cache: the same ids again, but the keys never grow by them;
# 3. a cached decode that samples the same token again and again (one token fed at a time: the same id each step).
# Eager softmax over a -inf causal bias; the model keeps its config as a dict.
from __future__ import annotations

import copy

import torch
from torch import nn

CONFIG = {"vocab": 40, "dim": 32, "heads": 4, "layers": 2}


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg["heads"]
        self.to_qkv = nn.Linear(cfg["dim"], 3 * cfg["dim"], bias=False)
        self.out = nn.Linear(cfg["dim"], cfg["dim"])

    def forward(self, x, past=None):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        s = k.shape[2]
        bias = torch.full((n, s), float("-inf")).triu(s - n + 1)
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + bias
        y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, d)), (k, v)


class LM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.emb = nn.Embedding(cfg["vocab"], cfg["dim"])
        self.layers = nn.ModuleList(Attention(cfg) for _ in range(cfg["layers"]))
        self.head = nn.Linear(cfg["dim"], cfg["vocab"])

    def forward(self, tokens, cache=None):
        x = self.emb(tokens)
        new = []
        for i, layer in enumerate(self.layers):
            h, kv = layer(x, None if cache is None else cache[i])
            x = x + h
            new.append(kv)
        return self.head(x), new


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = LM(CONFIG).eval()
    prompt = torch.randint(0, CONFIG["vocab"], (2, 5))

    seq = prompt  # 1. no cache: the whole sequence each step
    for _ in range(3):
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)

    system = torch.randint(0, CONFIG["vocab"], (2, 6))  # 2. a prefix cache reused for three samples of one turn
    _, prefix = model(system)
    turn = torch.randint(0, CONFIG["vocab"], (2, 4))
    for _ in range(3):
        logits, _ = model(turn, copy.deepcopy(prefix))

    same = torch.full((2, 1), 7)  # 3. one token at a time, the same token each step
    _, cache = model(prompt)
    for _ in range(3):
        _, cache = model(same, cache)
    print(seq.tolist())


if __name__ == "__main__":
    main()
