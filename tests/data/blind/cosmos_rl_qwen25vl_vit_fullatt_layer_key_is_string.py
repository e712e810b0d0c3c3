"""Qwen2.5-VL vision tower in cosmos-rl: full-attention layers never chosen (all layers windowed).

Citation: nvidia-cosmos/cosmos-rl#171 "fix: qwen2.5-vl model bug" (opened and merged 2025-07-24).
Bug (from the PR description): the vision encoder has two kinds of attention layers, full attention
(``fullatt_block_indexes``, e.g. [7, 15, 23, 31]) and window attention. The type was chosen with
``if layer_num in self.fullatt_block_indexes`` while iterating ``self.blocks.items()`` of an
``nn.ModuleDict``; ``layer_num`` is then the *string* key ("7"), never equal to an int, so every
block ran with ``cu_window_seqlens`` and the full-attention layers only saw their own window.
Fix: compare the integer layer index (``int(layer_num) in self.fullatt_block_indexes``).
Reproduction: a tiny Qwen2.5-VL ViT (window_size in pixels, spatial merge, window_index reordering,
cu_seqlens per frame and cu_window_seqlens per window), blocks held in an nn.ModuleDict keyed by
str(i) as in cosmos-rl; each block's attention builds the block-diagonal mask from the cu_seqlens it
is given and calls F.scaled_dot_product_attention. One image of 16x16 patches (8x8 merged tokens), windows
of 4x4 merged tokens (64 patches): layers 1 and 3 (full attention) see 256 keys per query after the fix, 64 before. I could only read the PR
description, not its diff; the surrounding code follows the HF Qwen2.5-VL vision model.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Qwen2_5_VLVisionConfig:
    depth: int = 4
    hidden_size: int = 32
    num_heads: int = 4
    patch_size: int = 14
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels: 112 // 2 // 14 = 4 merged tokens per window side
    fullatt_block_indexes: list = field(default_factory=lambda: [1, 3])


class VisionAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens):
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
        for i in range(1, len(cu_seqlens)):
            attention_mask[..., cu_seqlens[i - 1]: cu_seqlens[i], cu_seqlens[i - 1]: cu_seqlens[i]] = True
        q = q.transpose(0, 1)
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        attn_output = F.scaled_dot_product_attention(q, k, v, attention_mask, dropout_p=0.0)
        attn_output = attn_output.transpose(0, 1).reshape(seq_length, -1)
        return self.proj(attn_output)


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, cu_seqlens):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens=cu_seqlens)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_size = config.window_size
        self.fullatt_block_indexes = config.fullatt_block_indexes
        self.spatial_merge_unit = config.spatial_merge_size * config.spatial_merge_size
        # cosmos-rl keeps the blocks in a ModuleDict keyed by the layer number (for FSDP / PP wrapping)
        self.blocks = nn.ModuleDict({str(i): Qwen2_5_VLVisionBlock(config) for i in range(config.depth)})

    def get_window_index(self, grid_thw):
        window_index = []
        cu_window_seqlens = [0]
        window_index_id = 0
        vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
        for grid_t, grid_h, grid_w in grid_thw.tolist():
            llm_grid_h, llm_grid_w = grid_h // self.spatial_merge_size, grid_w // self.spatial_merge_size
            index = torch.arange(grid_t * llm_grid_h * llm_grid_w).reshape(grid_t, llm_grid_h, llm_grid_w)
            pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
            pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
            num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
            num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
            index_padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            index_padded = index_padded.reshape(grid_t, num_windows_h, vit_merger_window_size,
                                                num_windows_w, vit_merger_window_size)
            index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
                grid_t, num_windows_h * num_windows_w, vit_merger_window_size, vit_merger_window_size)
            seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
            index_padded = index_padded.reshape(-1)
            index_new = index_padded[index_padded != -100]
            window_index.append(index_new + window_index_id)
            cu_seqlens_tmp = seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]
            cu_window_seqlens.extend(cu_seqlens_tmp.tolist())
            window_index_id += grid_t * llm_grid_h * llm_grid_w
        return torch.cat(window_index, dim=0), cu_window_seqlens

    def forward(self, hidden_states, grid_thw):
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        cu_window_seqlens = torch.tensor(cu_window_seqlens, dtype=torch.int32)
        cu_window_seqlens = torch.unique_consecutive(cu_window_seqlens)

        seq_len, _ = hidden_states.size()
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        hidden_states = hidden_states[window_index, :, :].reshape(seq_len, -1)

        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)

        for layer_num, blk in self.blocks.items():
            if FIXED:
                is_full = int(layer_num) in self.fullatt_block_indexes
            else:
                is_full = layer_num in self.fullatt_block_indexes
            cu_seqlens_now = cu_seqlens if is_full else cu_window_seqlens
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now)

        reverse_indices = torch.argsort(window_index)
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        return hidden_states[reverse_indices, :, :].reshape(seq_len, -1)


def main():
    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig()
    model = Qwen2_5_VisionTransformer(config).eval()
    grid_thw = torch.tensor([[1, 16, 16]])  # one image, 16x16 patches -> 8x8 merged tokens -> 4 windows
    num_patches = int(grid_thw.prod(-1).sum())
    pixel_embeds = torch.randn(num_patches, config.hidden_size)
    with torch.no_grad():
        out = model(pixel_embeds, grid_thw)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
