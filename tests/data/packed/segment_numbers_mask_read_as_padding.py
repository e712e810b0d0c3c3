"""Two packed rows whose attention_mask numbers each packed sample (0 = padding), read as a padding mask only.

Bug: the model builds its additive mask from `attention_mask > 0` and a causal triangle, so the sample numbers
(1, 1, 2, 2, 2, ...) become "every token real" and each packed sample sees the ones packed before it in its row,
although the position_ids the batch hands restart at 0 with every sample. Fix: the mask also keeps each query to
keys of its own sample number (the rows are padded at their start, and their padding stays masked either way).
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class TinyConfig:
    vocab: int = 40
    width: int = 16
    heads: int = 2


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)

    def forward(self, h, bias):
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class PackedLM(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(16, cfg.width)
        self.block = Block(cfg)

    def forward(self, input_ids, attention_mask, position_ids):
        n = input_ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None] & (attention_mask > 0)[:, None, :]
        if FIXED:
            keep = keep & (attention_mask[:, :, None] == attention_mask[:, None, :])
        bias = torch.zeros(keep.shape).masked_fill(~keep, -1e9)[:, None]
        return self.block(self.embed(input_ids) + self.pos(position_ids), bias)


torch.manual_seed(0)
attention_mask = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 3, 3, 3, 3]])
position_ids = torch.tensor([[0, 0, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 0, 1, 2, 3]])
input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]])
with torch.no_grad():
    out = PackedLM(TinyConfig())(input_ids, attention_mask, position_ids)
print("done", tuple(out.shape))
