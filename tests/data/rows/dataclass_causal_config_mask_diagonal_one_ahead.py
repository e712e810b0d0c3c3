"""A hand-written language model whose dataclass config states `causal: bool = True` (held as self.cfg), run on a
right-padded batch. Its mask is built as `torch.tril(ones, diagonal=1)`: one diagonal too many, every query also sees
the next token (the one it is trained to predict when a loss is attached; here the model is only run forward).
`--fixed` builds `torch.tril(ones)`. The fixed model's output for each row is checked against each sequence run
alone, unpadded, through F.scaled_dot_product_attention(is_causal=True)."""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ModelConfig:
    vocab: int = 50
    dim: int = 16
    heads: int = 2
    layers: int = 2
    causal: bool = True


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.cfg.heads, d // self.cfg.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class LM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))

    def forward(self, ids, lengths):
        n = ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool)
        if self.cfg.causal:
            keep = torch.tril(keep) if FIXED else torch.tril(keep, diagonal=1)
        real = torch.arange(n)[None, :] < lengths[:, None]
        keep = keep[None, None] & real[:, None, None, :]
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, keep)
        return x


def alone(model, ids):
    x = model.emb(ids[None])
    for block in model.blocks:
        b, n, d = x.shape
        q, k, v = block.qkv(x).view(b, n, 3, model.cfg.heads, d // model.cfg.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + block.out(y.transpose(1, 2).reshape(b, n, d))
    return x[0]


if __name__ == "__main__":
    model = LM(ModelConfig()).eval()
    lengths = torch.tensor([6, 4])
    ids = torch.randint(1, 50, (2, 6))
    ids[1, 4:] = 0
    with torch.no_grad():
        out = model(ids, lengths)
        worst = max(float((out[b, :n] - alone(model, ids[b, :n])).abs().max()) for b, n in enumerate(lengths.tolist()))
    print(f"largest difference from each sequence alone, causal: {worst:.2e}")
    assert (worst < 1e-5) == FIXED
