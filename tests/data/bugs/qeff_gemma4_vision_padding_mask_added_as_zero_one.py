"""QEfficient Gemma 4 vision tower: the patch padding mask is added to the scores as 0/1.

Citation: quic/efficient-transformers#1159 ("Gemma4 E2B vision and decoder fix"), item 3:
"Fixed Gemma4 vision padding attention mask handling. QEff was passing a 0/1 mask directly into
vision attention, while Gemma4 attention expects an additive mask. Padding patch positions are
now masked with a large negative value, matching Hugging Face behavior." Read from the PR
description only (the diff was not available); the module below is written from it and from the
Hugging Face Gemma 4 vision tower, whose padded patches carry pixel_position_ids == -1.

Bug: the vision encoder turned the patch validity into ``attention_mask = (~padding).to(dtype)``
(1 for a real patch, 0 for padding) and handed it to an eager attention that does
``attn_weights = q @ k^T * scaling + attention_mask``. Adding 1 to every real key and 0 to the
padded ones leaves the padded patches fully attended.
Fix: an additive mask, 0 for real patches and finfo(dtype).min for padded ones.

Reproduction: images of 12 and 7 patches padded to max_patches = 12, two encoder layers.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class QEffGemma4VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, n, _ = hidden_states.shape
        shape = (b, n, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out, _ = eager_attention_forward(self, q, k, v, attention_mask, self.scaling)
        return self.o_proj(out.reshape(b, n, -1))


class QEffGemma4VisionEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = QEffGemma4VisionAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class QEffGemma4VisionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.patch_embedder = nn.Linear(config.patch_dim, config.hidden_size)
        self.position_embedding = nn.Embedding(config.position_embedding_size, config.hidden_size)
        self.layers = nn.ModuleList([QEffGemma4VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, pixel_values, pixel_position_ids):
        # pixel_values: (batch, max_patches, patch_dim); pixel_position_ids: (batch, max_patches, 2), -1 = padding
        padding_positions = (pixel_position_ids == -1).all(dim=-1)
        positions = pixel_position_ids.clamp(min=0)
        pos_index = positions[..., 0] * self.config.grid_width + positions[..., 1]
        hidden_states = self.patch_embedder(pixel_values) + self.position_embedding(pos_index)

        dtype = hidden_states.dtype
        if FIXED:
            attention_mask = torch.zeros(padding_positions.shape, dtype=dtype)
            attention_mask = attention_mask.masked_fill(padding_positions, torch.finfo(dtype).min)
        else:
            attention_mask = (~padding_positions).to(dtype)
        attention_mask = attention_mask[:, None, None, :]

        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states, padding_positions


def make_position_ids(h, w, max_patches):
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack([ys.flatten(), xs.flatten()], dim=-1)
    pad = torch.full((max_patches - h * w, 2), -1)
    return torch.cat([ids, pad])


if __name__ == "__main__":
    torch.manual_seed(0)
    from types import SimpleNamespace
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                             patch_dim=48, position_embedding_size=64, grid_width=8)
    model = QEffGemma4VisionModel(config).eval()
    max_patches = 12
    pixel_position_ids = torch.stack([make_position_ids(3, 4, max_patches), make_position_ids(1, 7, max_patches)])
    pixel_values = torch.randn(2, max_patches, 48)
    pixel_values[1, 7:] = 0.0  # processor pads with zero patches
    with torch.no_grad():
        hidden, padding = model(pixel_values, pixel_position_ids)
    print("image 1 patch 0", [round(v, 4) for v in hidden[1, 0, :3].tolist()])
