"""NVIDIA-NeMo/Speech#9672 (NeMo's "Gemma 2" PR; its review's "Layer 0 lacks sliding"): the attention read its window from
`self.layer_number = max(1, layer_number)`, the number clamped for another use, so layer 0 counted as layer 1 and
got no window while layers 2, 4, ... kept theirs; the fix reads the layer's own number. Written as a small Gemma 2
style model trained on packed sequences (cu_seqlens, as NeMo packs them), each layer building its mask from the
documents and its own window, with the config fields of Gemma 2 (sliding_window, layer_types: layer i is sliding
where i is even, transformers' configuration_gemma2.py)."""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma2Config:
    num_hidden_layers: int = 6
    sliding_window: int = 3
    hidden_size: int = 8
    layer_types: list = field(default_factory=lambda: ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                       for i in range(6)])


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.sliding_window_size = None
        if (layer_number if FIXED else self.layer_number) % 2 == 0:
            self.sliding_window_size = config.sliding_window
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, cu_seqlens):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        positions = torch.arange(x.shape[1])
        document = torch.searchsorted(cu_seqlens, positions, right=True)
        mask = (document[:, None] == document[None, :]) & (positions[:, None] >= positions[None, :])
        if self.sliding_window_size is not None:
            mask = mask & (positions[:, None] - positions[None, :] < self.sliding_window_size)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


class Gemma2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(SelfAttention(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden_states, cu_seqlens):
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, cu_seqlens)
        return hidden_states


torch.manual_seed(0)
with torch.no_grad():
    Gemma2Model(Gemma2Config())(torch.randn(1, 9, 8), cu_seqlens=torch.tensor([0, 5, 9]))
