"""A hand-written sliding-window decoder whose config is a dataclass held as `self.cfg`, run on a left-padded batch:
the window built with `<=` (one key wider than sliding_window, which counts the query itself); --fixed: `<`."""

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Cfg:
    dim: int = 8
    n_layers: int = 2
    sliding_window: int = 3


class Attn(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        n = x.shape[1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        near = (i - j < self.cfg.sliding_window) if FIXED else (i - j <= self.cfg.sliding_window)
        keep = (j <= i) & near & attention_mask[:, None, None, :].bool()
        keep = keep | ~keep.any(-1, keepdim=True)  # padding queries see every key (their output is dropped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).squeeze(1)


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Attn(cfg) for _ in range(cfg.n_layers))

    def forward(self, x, attention_mask):
        for layer in self.layers:
            x = x + layer(x, attention_mask)
        return x


torch.manual_seed(0)
mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    Decoder(Cfg())(torch.randn(2, 8, 8), attention_mask=mask)
