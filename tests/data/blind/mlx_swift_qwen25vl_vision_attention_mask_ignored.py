"""mlx-swift-lm Qwen2.5-VL vision encoder: the block-diagonal attention mask is built, then not used.

Citation: ml-explore/mlx-swift-lm#238 "Fix vision-encoder attention mask being ignored in Qwen2.5-VL"
(opened 2026-04-24, merged). Bug (PR description): ``Vision.Attention.callAsFunction`` receives
``attentionMask`` (a ``[1, seqLen, seqLen]`` boolean mask built from ``cu_seqlens`` for full-attention
layers and from ``cu_window_seqlens`` for window layers), but the SDPA call was hard-coded to
``mask: .none``, so every vision layer attended over all patches of all images: windows and image
boundaries were both lost.
Fix: turn the boolean mask into an additive mask in the query dtype (0 where allowed, -10000
elsewhere) and pass it to scaledDotProductAttention.
Reproduction: a torch port of the Swift vision model (``Vision.VisionModel`` -> ``Vision.Block`` ->
``Vision.Attention``; window index, cu_window_seqlens, full-attention block indexes from the config);
MLXFast.scaledDotProductAttention is rendered as F.scaled_dot_product_attention. Two images of 8x8
patches, windows of 2x2 merged tokens (16 patches). I read the PR description and its review diff
excerpt; the rest follows the structure of the Swift file (Swift is not run here).
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dims, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dims // num_heads) ** -0.5
        self.qkv = nn.Linear(dims, 3 * dims, bias=True)
        self.proj = nn.Linear(dims, dims)

    def forward(self, x, attention_mask):
        sequence_length = x.shape[0]
        q, k, v = self.qkv(x).reshape(sequence_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q = q.reshape(1, sequence_length, self.num_heads, -1).transpose(1, 2)
        k = k.reshape(1, sequence_length, self.num_heads, -1).transpose(1, 2)
        v = v.reshape(1, sequence_length, self.num_heads, -1).transpose(1, 2)
        if FIXED:
            # attentionMask is [1, seqLen, seqLen] boolean -- convert to an additive mask for SDPA
            bool_mask = attention_mask[None]
            mask = torch.where(bool_mask, torch.tensor(0, dtype=q.dtype), torch.tensor(-10000, dtype=q.dtype))
        else:
            mask = None
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        output = output.transpose(1, 2).reshape(sequence_length, -1)
        return self.proj(output)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.attention = Attention(config.hidden_size, config.num_heads)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.attention(self.norm1(hidden_states), attention_mask=attention_mask)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class VisionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.spatial_merge_unit = config.spatial_merge_size ** 2
        self.window_size = config.window_size
        self.patch_size = config.patch_size
        self.fullatt_block_indexes = config.fullatt_block_indexes
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.depth)])

    def get_window_index(self, frames):
        window_index, cu_window_seqlens, window_index_id = [], [0], 0
        vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
        for t, h, w in frames:
            llm_grid_h, llm_grid_w = h // self.spatial_merge_size, w // self.spatial_merge_size
            index = torch.arange(t * llm_grid_h * llm_grid_w).reshape(t, llm_grid_h, llm_grid_w)
            pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
            pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
            num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
            num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
            index_padded = F.pad(index, (0, pad_w, 0, pad_h), value=-100)
            index_padded = index_padded.reshape(t, num_windows_h, vit_merger_window_size, num_windows_w,
                                                vit_merger_window_size)
            index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
                t, num_windows_h * num_windows_w, vit_merger_window_size, vit_merger_window_size)
            seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
            index_padded = index_padded.reshape(-1)
            window_index.append(index_padded[index_padded != -100] + window_index_id)
            cu_window_seqlens.extend((seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]).tolist())
            window_index_id += t * llm_grid_h * llm_grid_w
        return torch.cat(window_index), cu_window_seqlens

    @staticmethod
    def attention_mask(sequence_length, cu_seqlens):
        mask = torch.zeros(sequence_length, sequence_length, dtype=torch.bool)
        for i in range(1, len(cu_seqlens)):
            start, end = int(cu_seqlens[i - 1]), int(cu_seqlens[i])
            mask[start:end, start:end] = True
        return mask

    def forward(self, hidden_states, frames):
        window_index, cu_window_seqlens = self.get_window_index(frames)
        cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens))
        seq_len = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        hidden_states = hidden_states[window_index].reshape(seq_len, -1)

        cu_seqlens = [0]
        for t, h, w in frames:
            for _ in range(t):
                cu_seqlens.append(cu_seqlens[-1] + h * w)
        full_attention_mask = self.attention_mask(seq_len, cu_seqlens)
        window_attention_mask = self.attention_mask(seq_len, cu_window_seqlens.tolist())

        for layer_num, block in enumerate(self.blocks):
            attention_mask = full_attention_mask if layer_num in self.fullatt_block_indexes else window_attention_mask
            hidden_states = block(hidden_states, attention_mask=attention_mask)

        reverse_indices = torch.argsort(window_index)
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        return hidden_states[reverse_indices].reshape(seq_len, -1)


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14,
                             spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1])
    model = VisionModel(config).eval()
    frames = [(1, 8, 8), (1, 8, 8)]  # two images
    hidden_states = torch.randn(sum(t * h * w for t, h, w in frames), config.hidden_size)
    with torch.no_grad():
        out = model(hidden_states, frames)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
