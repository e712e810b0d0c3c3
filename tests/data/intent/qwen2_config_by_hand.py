"""Qwen2 layers built by hand from transformers' own Qwen2Config and Qwen2Attention, each handed a mask the program
builds: it reads max_window_layers the wrong way round (the first max_window_layers layers sliding), where Qwen2
slides the layers from max_window_layers on (configuration_qwen2.py: its layer_types); --fixed: i >= max_window_layers."""

import sys

import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

FIXED = "--fixed" in sys.argv

config = Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
                     use_sliding_window=True, sliding_window=3, max_window_layers=1, attn_implementation="sdpa")


class HandBuiltQwen2(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary = Qwen2RotaryEmbedding(config)
        self.attn = torch.nn.ModuleList(Qwen2Attention(config, i) for i in range(config.num_hidden_layers))

    def forward(self, x):
        n = x.shape[1]
        position_ids = torch.arange(n)[None]
        rope = self.rotary(x, position_ids)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        for index, attn in enumerate(self.attn):
            sliding = index >= self.config.max_window_layers if FIXED else index < self.config.max_window_layers
            keep = (j <= i) & ((i - j < self.config.sliding_window) if self.config.use_sliding_window and sliding else True)
            x = x + attn(x, rope, attention_mask=keep[None, None])[0]
        return x


torch.manual_seed(0)
with torch.no_grad():
    HandBuiltQwen2(config).eval()(torch.randn(1, 7, 16))
