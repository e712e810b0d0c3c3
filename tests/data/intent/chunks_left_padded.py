"""Llama 4 style chunked attention, the chunk size a dataclass on `self.cfg`, run on a left-padded batch: the chunks
are cut on the columns (i // C == j // C), so a padded row's chunks start before its first token; --fixed: on each
row's positions (cumsum of its attention_mask), as transformers' chunked_overlay does."""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TextConfig:
    hidden_size: int = 4
    num_hidden_layers: int = 2
    attention_chunk_size: int = 3


class ChunkedLayer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, x, attention_mask):
        n = x.shape[-2]
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0) if FIXED else torch.arange(n).expand(x.shape[0], n)
        chunk = pos // self.cfg.attention_chunk_size
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = causal & (chunk[:, :, None] == chunk[:, None, :]) & attention_mask[:, None, :].bool()
        keep = keep | torch.eye(n, dtype=torch.bool)  # a padding query sees itself (its output is dropped)
        return x + F.scaled_dot_product_attention(x, x, x, attn_mask=keep[:, None])


class Model(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = torch.nn.ModuleList(ChunkedLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x, attention_mask):
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x


with torch.no_grad():
    Model(TextConfig())(torch.randn(2, 1, 8, 4), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8]))
