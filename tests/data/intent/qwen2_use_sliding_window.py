"""Qwen2 layers built by hand from transformers' Qwen2Config with use_sliding_window=False (Qwen2's default: no layer
slides, its layer_types all full_attention) and the program's window read the wrong way round (applied where
use_sliding_window is False, its size from the program's own setting); --fixed: only where it is True."""

import sys

import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

FIXED = "--fixed" in sys.argv
WINDOW = 3

config = Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                     use_sliding_window=False, sliding_window=WINDOW, attn_implementation="sdpa")


class Qwen2Layers(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary = Qwen2RotaryEmbedding(config)
        self.attn = torch.nn.ModuleList(Qwen2Attention(config, i) for i in range(config.num_hidden_layers))

    def forward(self, x):
        n = x.shape[1]
        rope = self.rotary(x, torch.arange(n)[None])
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        windowed = self.config.use_sliding_window if FIXED else not self.config.use_sliding_window
        keep = (j <= i) & ((i - j < WINDOW) if windowed else True)
        for attn in self.attn:
            x = x + attn(x, rope, attention_mask=keep[None, None])[0]
        return x


torch.manual_seed(0)
with torch.no_grad():
    Qwen2Layers(config).eval()(torch.randn(1, 7, 16))
