"""Pix2Struct visual encoder: the patch padding mask is broadcast over queries instead of keys.

Citation: huggingface/transformers#23974 ("Pix2Struct: wrong attention mask broadcasting in the
visual encoder"), fixed by PR #23976 ("fix wrong broadcast axis of attention mask in visual
encoder"). Issue and PR descriptions read; the pre-fix lines are those quoted in the Pix2Struct
review thread of PR #21400 and the issue (modeling_pix2struct.py, transformers 4.29, L200-220).

Bug: ``Pix2StructVisionAttention.forward`` turns the [batch, seq_len] patch mask into a bias with
``attention_mask[:, None, :, None]`` -- shape [batch, 1, query, 1] -- so padded *query* rows are
masked (every key -inf) while every real query still attends to the zero padding patches.
Fix: ``attention_mask[:, None, None, :]`` (mask the padded *keys*).

Reproduction: the processor pads ``flattened_patches`` with all-zero rows up to ``max_patches``;
``Pix2StructVisionModel.forward`` derives ``attention_mask`` from them (sum != 0). Two images with
5 and 3 real patches out of max_patches=6 go through one encoder layer (eager softmax over
q @ k^T + bias, as upstream). The hyper-parameters are held in transformers'
``Pix2StructVisionConfig`` (config object only, random weights).
"""
import sys

import torch
import torch.nn as nn
from transformers import Pix2StructVisionConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Pix2StructVisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_attention_heads
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.query = nn.Linear(self.hidden_size, self.inner_dim, bias=False)
        self.key = nn.Linear(self.hidden_size, self.inner_dim, bias=False)
        self.value = nn.Linear(self.hidden_size, self.inner_dim, bias=False)
        self.output = nn.Linear(self.inner_dim, self.hidden_size, bias=False)
        self.gradient_checkpointing = False

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def to_projection_shape(states):
            return states.contiguous().view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        query_states = to_projection_shape(self.query(hidden_states))
        key_states = to_projection_shape(self.key(hidden_states))
        value_states = to_projection_shape(self.value(hidden_states))

        # compute scores
        scores = torch.matmul(query_states, key_states.transpose(3, 2))

        if position_bias is None:
            position_bias = torch.zeros(
                (1, self.n_heads, seq_length, seq_length), device=scores.device, dtype=scores.dtype
            )
            if attention_mask is None:
                attention_mask = torch.ones((batch_size, seq_length), device=scores.device, dtype=scores.dtype)

            if attention_mask.dim() == 2:
                if FIXED:
                    position_bias = position_bias + attention_mask[:, None, None, :].to(position_bias.device)
                else:
                    position_bias = position_bias + attention_mask[:, None, :, None].to(position_bias.device)
            else:
                # (batch_size, n_heads, seq_length, key_length)
                position_bias = position_bias + attention_mask.to(position_bias.device)
            position_bias = 1 - position_bias

        position_bias_masked = position_bias.masked_fill(position_bias == 1, torch.finfo(scores.dtype).min)
        scores += position_bias_masked
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))

        # (batch_size, n_heads, seq_length, key_length)
        attn_weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)
        return self.output(attn_output), position_bias


class Pix2StructVisionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_projection = nn.Linear(config.patch_embed_hidden_size, config.hidden_size)
        self.layers = nn.ModuleList([Pix2StructVisionAttention(config) for _ in range(config.num_hidden_layers)])

    def forward(self, flattened_patches, attention_mask=None):
        if attention_mask is None:
            # check where `flattened_patches` is not 0
            attention_mask = (flattened_patches.sum(dim=-1) != 0).float()
        # first two columns are row/col ids, the rest the pixels
        hidden_states = self.patch_projection(flattened_patches[:, :, 2:])
        position_bias = None
        for layer in self.layers:
            out, position_bias = layer(hidden_states, attention_mask=attention_mask, position_bias=position_bias)
            hidden_states = hidden_states + out
        return hidden_states, attention_mask


if __name__ == "__main__":
    config = Pix2StructVisionConfig(
        hidden_size=32, patch_embed_hidden_size=12, d_ff=64, d_kv=8, num_attention_heads=4,
        num_hidden_layers=2, seq_len=6,
    )
    model = Pix2StructVisionModel(config).eval()
    max_patches, n_real = 6, [5, 3]
    flattened_patches = torch.zeros(2, max_patches, 2 + 12)
    for b, n in enumerate(n_real):
        flattened_patches[b, :n, 0] = torch.arange(1, n + 1).float()  # row ids start at 1
        flattened_patches[b, :n, 1] = 1.0
        flattened_patches[b, :n, 2:] = torch.randn(n, 12)
    with torch.no_grad():
        hidden, mask = model(flattened_patches)
        alone, _ = model(flattened_patches[1:, :3])
    diff = (hidden[1, :3] - alone[0]).abs().max().item()
    print("fixed" if FIXED else "buggy", "padded image vs unpadded, real patches max diff:", f"{diff:.4f}")
