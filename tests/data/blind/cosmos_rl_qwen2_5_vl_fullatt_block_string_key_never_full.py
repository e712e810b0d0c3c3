"""cosmos-rl Qwen2.5-VL vision tower: full-attention blocks never selected (string ModuleDict keys).

Citation: nvidia-cosmos/cosmos-rl PR #171 "fix: qwen2.5-vl model bug" (merged, July 2025).

Bug (from the PR description): the Qwen2.5-VL vision encoder alternates window-attention blocks and
full-attention blocks (`fullatt_block_indexes`, e.g. [7, 15, 23, 31]). cosmos-rl keeps the blocks in an
`nn.ModuleDict`, whose keys are strings, and chose the attention type with
`if layer_num in self.fullatt_block_indexes`. A string key is never in the list of ints, so every block,
including the full-attention ones, was handed `cu_window_seqlens`: no vision token ever attended
outside its window.

Fix: compare the integer layer index (`int(layer_num) in self.fullatt_block_indexes`).

This program: one image of 8x8 merged patches (already window-reordered), four windows of 16 tokens,
a four-block tower whose block 3 is a full-attention block; each block's attention renders its
`cu_seqlens` as a block-diagonal boolean mask for `F.scaled_dot_product_attention` (the torch path
of the varlen flash call). Only the selection line comes from the PR; the rest is written after the
Hugging Face / vLLM Qwen2.5-VL vision code as known, reduced in size.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Qwen2_5_VLVisionAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens):
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 2, 0, 3).unbind(0)
        attention_mask = torch.zeros([1, seq_length, seq_length], dtype=torch.bool)
        for i in range(1, len(cu_seqlens)):
            attention_mask[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = True
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.proj(attn_output.transpose(0, 1).reshape(seq_length, -1))


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Qwen2_5_VLVisionAttention(dim, num_heads)

    def forward(self, hidden_states, cu_seqlens):
        return hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens=cu_seqlens)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, dim=32, num_heads=4, depth=4, fullatt_block_indexes=(3,)):
        super().__init__()
        # ModuleDict so that checkpoint keys stay "blocks.<i>.*" under pipeline-parallel slicing
        self.blocks = nn.ModuleDict({str(i): Qwen2_5_VLVisionBlock(dim, num_heads) for i in range(depth)})
        self.fullatt_block_indexes = list(fullatt_block_indexes)

    def forward(self, hidden_states, cu_seqlens, cu_window_seqlens):
        for layer_num, blk in self.blocks.items():
            if FIXED:
                is_full = int(layer_num) in self.fullatt_block_indexes
            else:
                is_full = layer_num in self.fullatt_block_indexes
            cu_seqlens_now = cu_seqlens if is_full else cu_window_seqlens
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now)
        return hidden_states


def main():
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 64], dtype=torch.int32)
    cu_window_seqlens = torch.tensor([0, 16, 32, 48, 64], dtype=torch.int32)
    model = Qwen2_5_VisionTransformer().eval()
    x = torch.randn(64, 32)
    with torch.no_grad():
        out = model(x, cu_seqlens, cu_window_seqlens)
    print("fixed" if FIXED else "buggy", "vision out sum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
