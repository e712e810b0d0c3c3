"""ml-explore/mlx-lm#390: the sliding-window mask had one too many values: with window_size 128 each query attended to
itself and 128 earlier keys (129), where the model (gemma3; gpt-oss's reference gpt_oss/torch/model.py builds its mask
with torch.tril(..., diagonal=-sliding_window)) means 128 in all. Written as a small torch model whose config names the
window and the layer types, the mask built as the buggy and the fixed code built it."""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelConfig:
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])
    dim: int = 8


def create_causal_mask(n, window_size=None):
    linds = torch.arange(n)[:, None]
    rinds = torch.arange(n)[None, :]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size) if FIXED else mask & (linds <= rinds + window_size)
    return mask


class Block(nn.Module):
    def __init__(self, config, layer_type):
        super().__init__()
        self.window = config.sliding_window if layer_type == "sliding_attention" else None
        self.qkv = nn.Linear(config.dim, 3 * config.dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=create_causal_mask(x.shape[1], self.window)).squeeze(1)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Block(config, kind) for kind in config.layer_types)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


torch.manual_seed(0)
with torch.no_grad():
    Model(ModelConfig())(torch.randn(1, 8, 8))
