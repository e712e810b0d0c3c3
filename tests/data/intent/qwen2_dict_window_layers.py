"""A Qwen2 port whose config is a dict held as `self.config` (use_sliding_window, sliding_window, max_window_layers, as
Qwen2's config.json has them): it windows the layers below max_window_layers, the wrong way round; --fixed: those
from max_window_layers on, as Qwen2 (transformers' configuration_qwen2.py) does."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Qwen2Port(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(config["num_hidden_layers"]))

    def forward(self, x):
        n = x.shape[-2]
        for idx, layer in enumerate(self.layers):
            below = idx < self.config["max_window_layers"]
            window = self.config["sliding_window"] if self.config["use_sliding_window"] and (below != FIXED) else n
            keep = torch.ones(n, n, dtype=torch.bool).tril().triu(-(window - 1))
            x = x + F.scaled_dot_product_attention(layer(x), x, x, attn_mask=keep)
        return x


config = {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 2, "max_window_layers": 2}
with torch.no_grad():
    Qwen2Port(config)(torch.randn(1, 1, 6, 4))
