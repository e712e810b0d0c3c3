"""Mimi's encoder transformer builds a plain causal mask, ignoring ``config.sliding_window``.

Citation: huggingface/transformers#43971 "[Mimi] Calibrate to ensure encoder streaming performs correctly"
(merged). Mimi (the Moshi / Kyutai audio tokenizer) runs a causal transformer over the encoder's frames;
the paper and the config (``MimiConfig.sliding_window = 250``, 10 s of 25 Hz frames) limit each frame to
the last 250 frames. ``MimiTransformerModel.forward`` built its mask with ``create_causal_mask`` over a
DynamicCache, so long inputs attended to every earlier frame and the whole-input encode differed from the
streaming encode. (The PR also turns ``use_cache`` on when ``use_streaming=True``; that part is not
reproduced here.)

Fix: build the mask with ``create_sliding_window_causal_mask`` so each frame sees only the last
``config.sliding_window`` frames.

This program: a MimiConfig-like dataclass holding ``sliding_window`` (8 here, so a 14-frame input is
longer than the window), a small MimiTransformerModel whose layers call F.scaled_dot_product_attention with
the 4D mask the model builds. The two mask builders follow transformers' masking_utils (a causal
mask function, and the same with a sliding-window overlay). Buggy: frame 13 attends frames 0..13;
``--fixed``: frames 6..13.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class MimiConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    sliding_window: int = 8
    use_cache: bool = False


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window

    return inner_mask


def _build_4d_mask(mask_function, batch_size, cache_position, kv_length, attention_mask):
    kv_idx = torch.arange(kv_length)
    mask = mask_function(0, 0, cache_position[:, None], kv_idx[None, :])
    mask = mask[None, None].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :kv_length].bool()
    return mask


def create_causal_mask(config, input_embeds, attention_mask, cache_position):
    return _build_4d_mask(causal_mask_function, input_embeds.shape[0], cache_position, input_embeds.shape[1],
                          attention_mask)


def create_sliding_window_causal_mask(config, input_embeds, attention_mask, cache_position):
    window = sliding_window_overlay(config.sliding_window)

    def mask_function(b, h, q, kv):
        return causal_mask_function(b, h, q, kv) & window(b, h, q, kv)

    return _build_4d_mask(mask_function, input_embeds.shape[0], cache_position, input_embeds.shape[1],
                          attention_mask)


class MimiAttention(nn.Module):
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


class MimiTransformerLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MimiAttention(config)
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


class MimiTransformerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MimiTransformerLayer(config) for _ in range(config.num_hidden_layers))

    def _update_causal_mask(self, hidden_states, attention_mask, cache_position):
        if FIXED:
            return create_sliding_window_causal_mask(self.config, hidden_states, attention_mask, cache_position)
        return create_causal_mask(self.config, hidden_states, attention_mask, cache_position)

    def forward(self, hidden_states, attention_mask=None, cache_position=None):
        if cache_position is None:
            cache_position = torch.arange(hidden_states.shape[1])
        causal_mask = self._update_causal_mask(hidden_states, attention_mask, cache_position)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        return hidden_states


def main():
    torch.manual_seed(0)
    config = MimiConfig()
    model = MimiTransformerModel(config).eval()
    frames = torch.randn(1, 14, config.hidden_size)  # encoder frames after the conv downsampling
    with torch.no_grad():
        out = model(frames)
        mask = model._update_causal_mask(frames, None, torch.arange(frames.shape[1]))
    seen = mask[0, 0, -1].nonzero().flatten().tolist()
    print("frame 13 attends frames", seen[0], "..", seen[-1], "| out norm", round(float(out.norm()), 4))


if __name__ == "__main__":
    main()
