"""Layer types hard-coded by index against a config that lists them: the config (a dataclass on `self.config`) says
layer 0 is full and layer 1 sliding, the model windows the even layers (`i % 2 == 0`); --fixed: it reads
config.layer_types."""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelConfig:
    sliding_window: int = 2
    layer_types: list = field(default_factory=lambda: ["full_attention", "sliding_attention"] * 2)


def causal_mask(n, window=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window else keep


class Layer(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, x):
        return x + F.scaled_dot_product_attention(x, x, x, attn_mask=causal_mask(x.shape[-2], self.window))


class Model(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        sliding = [kind == "sliding_attention" for kind in config.layer_types] if FIXED else \
            [i % 2 == 0 for i in range(len(config.layer_types))]
        self.layers = torch.nn.ModuleList(Layer(config.sliding_window if s else None) for s in sliding)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


with torch.no_grad():
    Model(ModelConfig())(torch.randn(1, 2, 6, 4))
