# Written another way: the same bug as Stylish-TTS b97a5b6 (q/k/v handed to attention as (B, L, H, D) where it reads
# (B, H, L, D)), in a small decoder-only music-token model with a config dataclass and hand-written attention: the
# projections are split into heads with `.view(B, T, n_head, head_dim)` and the transpose to (B, n_head, T, head_dim)
# is missing, so `q @ k.transpose(-2, -1)` makes (B, T, n_head, n_head) scores: each event token attends over its own
# 4 heads, and the causal triangle built from the scores' last axis orders heads, not time steps. The fix transposes.
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class DecoderConfig:
    vocab: int = 48
    d_model: int = 32
    n_head: int = 4
    n_layer: int = 2
    max_len: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.query = nn.Linear(cfg.d_model, cfg.d_model)
        self.key = nn.Linear(cfg.d_model, cfg.d_model)
        self.value = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def split(self, x):
        b, t, _ = x.shape
        x = x.view(b, t, self.n_head, self.head_dim)
        return x.transpose(1, 2) if FIXED else x

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        n = att.size(-1)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~causal, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = att @ v
        if FIXED:
            y = y.transpose(1, 2)
        return self.proj(y.reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        width = 4 * cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, width), nn.GELU(), nn.Linear(width, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MusicDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    torch.manual_seed(0)
    cfg = DecoderConfig()
    model = MusicDecoder(cfg)
    ids = torch.randint(0, cfg.vocab, (3, 12))
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    print(f"fixed={FIXED} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
