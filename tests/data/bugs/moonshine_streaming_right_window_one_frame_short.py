"""Moonshine Streaming encoder: the right (lookahead) window sees one future frame too few.

Citation: huggingface/transformers#46305 ("MoonshineStreaming: sliding_window_mask_function off-by-one —
right_window_size=4 attends to 3 future frames instead of 4"), fix proposed in huggingface/transformers#47162.
``sliding_window_mask_function`` in modeling_moonshine_streaming.py builds each encoder layer's
(left, right) window mask with ``right_mask = (dist < 0) & (-dist < right_window_size)`` where
``dist = q_idx - kv_idx``: the strict ``<`` drops the frame exactly ``right_window_size`` ahead, so the
configured lookahead of 4 frames (80 ms at 50 Hz, per the Moonshine v2 paper) is only 3 frames (60 ms).

Fix: ``right_mask = (dist < 0) & (-dist <= right_window_size)``; the left window is unchanged.

This program: the encoder config holds per-layer ``sliding_windows`` ((16, 4) for the lookahead layers,
(16, 0) for the causal ones, as the model's config does); the mask function is evaluated over all (query, key)
frame pairs, as transformers' masking_utils does for the sdpa path, and each layer runs
F.scaled_dot_product_attention over 24 frames. Buggy:
a query at frame 10 of a (16, 4) layer sees frames 11..13 ahead; ``--fixed``: 11..14.
"""
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class MoonshineStreamingEncoderConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 4
    intermediate_size: int = 64
    # (left, right) frames each layer sees; the first and last layers look ahead
    sliding_windows: list = field(default_factory=lambda: [(16, 4), (16, 0), (16, 0), (16, 4)])


def sliding_window_mask_function(sliding_window):
    """Frames within ``left`` behind (the query itself included) and ``right`` ahead."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        left_window_size, right_window_size = sliding_window
        dist = q_idx - kv_idx
        left_mask = (dist >= 0) & (dist < left_window_size)
        if FIXED:
            right_mask = (dist < 0) & (-dist <= right_window_size)
        else:
            right_mask = (dist < 0) & (-dist < right_window_size)
        return left_mask | right_mask

    return inner_mask


class MoonshineStreamingEncoderAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MoonshineStreamingEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MoonshineStreamingEncoderAttention(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            nn.GELU(),
            nn.Linear(config.intermediate_size, config.hidden_size),
        )

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MoonshineStreamingEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MoonshineStreamingEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, inputs_embeds):
        b, t, _ = inputs_embeds.shape
        hidden_states = inputs_embeds
        cache_position = torch.arange(t)
        for layer, window in zip(self.layers, self.config.sliding_windows):
            # the sdpa path of masking_utils: the mask function evaluated over all (q, kv) index pairs
            mask_function = sliding_window_mask_function(window)
            attention_mask = mask_function(0, 0, cache_position[:, None], cache_position[None, :])
            hidden_states = layer(hidden_states, attention_mask.expand(b, 1, t, t))
        return hidden_states


def main():
    torch.manual_seed(0)
    config = MoonshineStreamingEncoderConfig()
    encoder = MoonshineStreamingEncoder(config).eval()
    frames = torch.randn(1, 24, config.hidden_size)
    with torch.no_grad():
        out = encoder(frames)
    fn = sliding_window_mask_function(config.sliding_windows[0])
    q = torch.tensor(10)
    ahead = [kv for kv in range(11, 24) if bool(fn(0, 0, q, torch.tensor(kv)))]
    print("frame 10 looks ahead to", ahead, "| out norm", round(float(out.norm()), 4))


if __name__ == "__main__":
    main()
