"""mlx-vlm Qwen2-VL vision tower: the per-image block mask is additive ones/zeros, so it masks nothing.

Citation: Blaizzy/mlx-vlm#704 ("Fix incorrect attention mask in Qwen2-VL Vision"), commit 79fddfc5 in
``mlx_vlm/models/qwen2_vl/vision.py``. The upstream code is
MLX (``mx.fast.scaled_dot_product_attention``); this program ports the few lines to torch, where
``F.scaled_dot_product_attention`` also adds a float mask to the scores.

Bug: ``Attention.__call__`` of the vision encoder builds ``attention_mask = mx.ones((1, S, S), dtype=x.dtype)``
and writes ``attention_mask[start:end, start:end] = 0`` for each image span of ``cu_seqlens``. As an
additive mask, 1 vs 0 only nudges scores: patches of different images (packed into one sequence) attend
each other freely. (The indexing also hits the size-1 leading dim, so most spans are not even written.)
Fix: ``attention_mask = mx.zeros((seq_length, seq_length), dtype=mx.bool_)`` with
``attention_mask[start:end, start:end] = True`` per image: a boolean mask, True inside each image's block.

This program: the vision attention over two images packed into one sequence, ``grid_thw = [[1, 2, 2],
[1, 2, 3]]`` (4 + 6 patches), ``cu_seqlens`` computed as the project does from ``grid_thw``. Rotary
position embedding is left out (it does not touch the mask).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 16) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):
        seq_length = x.shape[0]
        qkv = self.qkv(x).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
        q, k, v = qkv.split(1)

        if FIXED:
            attention_mask = torch.zeros((seq_length, seq_length), dtype=torch.bool)
            for i in range(1, len(cu_seqlens)):
                start = int(cu_seqlens[i - 1])
                end = int(cu_seqlens[i])
                attention_mask[start:end, start:end] = True
        else:
            attention_mask = torch.ones((1, seq_length, seq_length), dtype=x.dtype)
            for i in range(1, len(cu_seqlens)):
                start = int(cu_seqlens[i - 1])
                end = int(cu_seqlens[i])
                attention_mask[start:end, start:end] = 0

        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        output = F.scaled_dot_product_attention(q, k, v, scale=self.scale, attn_mask=attention_mask)
        output = output.transpose(1, 2).reshape(seq_length, -1)
        return self.out_proj(output)


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)

    def forward(self, hidden_states, cu_seqlens):
        return hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens=cu_seqlens)


class VisionModel(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, depth=1):
        super().__init__()
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(embed_dim, num_heads) for _ in range(depth))

    def forward(self, hidden_states, grid_thw):
        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)
        for blk in self.blocks:
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens)
        return hidden_states


def main():
    torch.manual_seed(0)
    model = VisionModel().eval()
    grid_thw = torch.tensor([[1, 2, 2], [1, 2, 3]])
    hidden_states = torch.randn(int((grid_thw.prod(-1)).sum()), 32)
    with torch.no_grad():
        out = model(hidden_states, grid_thw)
    print("vision features", tuple(out.shape), "image-0 sum %.5f" % out[:4].abs().sum())


if __name__ == "__main__":
    main()
