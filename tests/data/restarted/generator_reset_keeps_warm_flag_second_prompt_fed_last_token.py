"""A text generator module that keeps its K/V cache and a "warm" flag in one state dict; `reset()` empties the cache
for the next batch of prompts but (before the fix) leaves `state["warm"] = True`, so the next batch is taken for a
continuation: only its last token is fed, and the cache is built from that one token.

Written another way from lag-llama 5f0393d: a decoder over token ids, its config a dict, three prompts left-padded
(row 0 by 2, row 2 by 1), eager attention (scores softmaxed by hand behind an additive mask), a cache that grows.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
CONFIG = {"vocab": 50, "dim": 32, "heads": 2, "layers": 2, "pad_id": 0}


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads, self.dim = cfg["heads"], cfg["dim"]
        self.qkv = nn.Linear(self.dim, 3 * self.dim)
        self.out = nn.Linear(self.dim, self.dim)

    def forward(self, x, bias, past):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        weights = torch.softmax(scores, dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, self.dim)
        return x + self.out(y), (k, v)


class Generator(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab"], cfg["dim"])
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["layers"])])
        self.head = nn.Linear(cfg["dim"], cfg["vocab"])
        self.state = {"cache": [None] * cfg["layers"], "warm": False}

    def step(self, ids, attention_mask):
        new = ids[:, -1:] if self.state["warm"] else ids  # the rest is in the cache
        t, total = new.shape[1], ids.shape[1]
        past = self.state["cache"][0]
        keys = attention_mask[:, total - t - (0 if past is None else past[0].shape[2]):]
        q_pos = torch.arange(keys.shape[1] - t, keys.shape[1])
        allowed = (torch.arange(keys.shape[1])[None, :] <= q_pos[:, None])[None] & keys.bool()[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        x = self.embed(new)
        for i, layer in enumerate(self.layers):
            x, self.state["cache"][i] = layer(x, bias, self.state["cache"][i])
        self.state["warm"] = True
        return self.head(x[:, -1])

    def reset(self):
        """Empties the cache: the next batch of prompts starts over."""
        self.state["cache"] = [None] * self.cfg["layers"]
        if FIXED:
            self.state["warm"] = False

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, new_tokens=3):
        for _ in range(new_tokens):
            token = self.step(input_ids, attention_mask).argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, token], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        self.reset()
        return input_ids


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CONFIG["vocab"], (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, CONFIG["pad_id"]), mask


def main():
    torch.manual_seed(0)
    model = Generator(CONFIG).eval()
    for seed in (1, 2):
        ids, mask = batch(seed)
        print(model(ids, mask)[:, -3:].tolist())


if __name__ == "__main__":
    main()
