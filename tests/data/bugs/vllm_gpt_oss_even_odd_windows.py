"""vllm-project/vllm#33594 (split from #33124): vLLM's GPT-OSS gave a layer the sliding window where its index is even
(`per_layer_sliding_window=config.sliding_window if self.layer_idx % 2 == 0 else None`), whatever config.layer_types
says; the fix reads `config.layer_types[self.layer_idx] == "sliding_attention"`. With layer_types that do not
alternate (here three sliding layers, then a full one) layer 1 loses its window. Written as vLLM's attention reduced to
a small module: a batch of two requests packed into one row of tokens, each request's `positions` starting at 0, and
each layer masking by request, causality and its own window."""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class GptOssConfig:
    num_hidden_layers: int = 4
    sliding_window: int = 3
    hidden_size: int = 8
    layer_types: list = field(default_factory=lambda: ["sliding_attention"] * 3 + ["full_attention"])


class OAIAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        if FIXED:
            sliding = config.layer_types[self.layer_idx] == "sliding_attention"
        else:
            sliding = self.layer_idx % 2 == 0
        self.sliding_window = config.sliding_window if sliding else None
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, hidden_states, positions):
        q, k, v = self.qkv(hidden_states).unsqueeze(0).unsqueeze(0).chunk(3, dim=-1)
        request = torch.cumsum(positions == 0, dim=0)
        mask = (request[:, None] == request[None, :]) & (positions[:, None] >= positions[None, :])
        if self.sliding_window is not None:
            mask = mask & (positions[:, None] - positions[None, :] < self.sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 0]


class GptOssModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(OAIAttention(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden_states, positions):
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, positions)
        return hidden_states


torch.manual_seed(0)
with torch.no_grad():  # two requests of 6 and 4 tokens, packed as vLLM schedules them
    GptOssModel(GptOssConfig())(torch.randn(10, 8), positions=torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3]))
