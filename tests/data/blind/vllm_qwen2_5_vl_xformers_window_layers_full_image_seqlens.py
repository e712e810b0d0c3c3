"""vLLM Qwen2.5-VL vision tower: window-attention layers get the full-image seqlens (xformers backend).

Citation: vllm-project/vllm PR #15200 "[Bugfix] Fix incorrect qwen2.5-vl attention mask
pre-computation" (merged; fixes #15122 and #15197), a regression from PR #14377.

Bug: #14377 moved the per-layer `max_seqlen` / `seqlens` computation out of the block loop of
`Qwen2_5_VisionTransformer.forward` and computed them once, from `cu_seqlens` (one segment per
image). The blocks that are not in `fullatt_block_indexes` are handed `cu_window_seqlens`, but on
the xformers backend the attention builds its mask with
`BlockDiagonalMask.from_seqlens(q_seqlen=seqlens)`, i.e. from the full-image `seqlens`. So the
windowed layers attended across the whole image instead of inside their 2x2-merged window.

Fix: compute `max_seqlen` / `seqlens` for both the full and the window segmentation
(`compute_attn_mask_seqlen`) and hand each block the pair that matches its `cu_seqlens_now`.

This program: a two-image batch of patches (already window-reordered, as `get_window_index` does),
a tiny four-block tower whose block 3 is a full-attention block, and the xformers path with
`BlockDiagonalMask` rendered as a boolean block-diagonal mask into
`F.scaled_dot_product_attention` (xformers is not available on CPU). Sources: the PR description
and the diff hunk shown in its review thread (the removed lines computed `max_seqlen`/`seqlens`
from `cu_seqlens` before the loop); the rest of the tower is written after vLLM's
qwen2_5_vl.py as known, reduced in size.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.attn_bias.BlockDiagonalMask (CPU rendering)."""

    def __init__(self, q_seqlen):
        self.q_seqlen = list(q_seqlen)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, device=None):
        return cls(q_seqlen)

    def materialize(self, n, device=None):
        seg = torch.repeat_interleave(torch.arange(len(self.q_seqlen)), torch.tensor(self.q_seqlen))
        assert seg.numel() == n
        return seg[:, None] == seg[None, :]


def memory_efficient_attention_forward(q, k, v, attn_bias):
    # xformers takes (b, s, h, d); render the block-diagonal bias as an SDPA boolean mask
    n = q.shape[1]
    mask = attn_bias.materialize(n)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)


class Qwen2_5_VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_backend = "XFORMERS"

    def forward(self, x, cu_seqlens, max_seqlen=None, seqlens=None):
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))  # (b=1, s, h, d)
        if self.attn_backend == "XFORMERS":
            attn_bias = BlockDiagonalMask.from_seqlens(q_seqlen=seqlens, kv_seqlen=None, device=q.device)
            context = memory_efficient_attention_forward(q, k, v, attn_bias=attn_bias)
        else:
            raise NotImplementedError(self.attn_backend)
        return self.proj(context.reshape(s, -1))


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Qwen2_5_VisionAttention(dim, num_heads)

    def forward(self, x, cu_seqlens, max_seqlen=None, seqlens=None):
        return x + self.attn(self.norm1(x), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqlens=seqlens)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, dim=32, num_heads=4, depth=4, fullatt_block_indexes=(3,)):
        super().__init__()
        self.blocks = nn.ModuleList([Qwen2_5_VisionBlock(dim, num_heads) for _ in range(depth)])
        self.fullatt_block_indexes = list(fullatt_block_indexes)
        self.attn_backend = "XFORMERS"

    def compute_attn_mask_seqlen(self, cu_seqlens):
        max_seqlen, seqlens = None, None
        if self.attn_backend == "FLASH_ATTN":
            max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
        elif self.attn_backend == "XFORMERS":
            seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return max_seqlen, seqlens

    def forward(self, hidden_states, cu_seqlens, cu_window_seqlens):
        if FIXED:
            max_seqlen_full, seqlens_full = self.compute_attn_mask_seqlen(cu_seqlens)
            max_seqlen_window, seqlens_window = self.compute_attn_mask_seqlen(cu_window_seqlens)
            for layer_num, blk in enumerate(self.blocks):
                if layer_num in self.fullatt_block_indexes:
                    cu_seqlens_now, max_seqlen_now, seqlens_now = cu_seqlens, max_seqlen_full, seqlens_full
                else:
                    cu_seqlens_now, max_seqlen_now, seqlens_now = cu_window_seqlens, max_seqlen_window, seqlens_window
                hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now, max_seqlen=max_seqlen_now, seqlens=seqlens_now)
        else:
            # pre-computed once, from the full-image segmentation (#14377)
            max_seqlen = None
            seqlens = None
            if self.attn_backend == "FLASH_ATTN":
                max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
            elif self.attn_backend == "XFORMERS":
                seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            for layer_num, blk in enumerate(self.blocks):
                if layer_num in self.fullatt_block_indexes:
                    cu_seqlens_now = cu_seqlens
                else:
                    cu_seqlens_now = cu_window_seqlens
                hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now, max_seqlen=max_seqlen, seqlens=seqlens)
        return hidden_states


def main():
    torch.manual_seed(0)
    # image 0: 8x8 patches -> 4 windows of 16; image 1: 4x8 patches -> 2 windows of 16
    grid_sizes = [64, 32]
    cu_seqlens = torch.tensor([0, 64, 96], dtype=torch.int32)
    cu_window_seqlens = torch.tensor([0, 16, 32, 48, 64, 80, 96], dtype=torch.int32)
    model = Qwen2_5_VisionTransformer().eval()
    x = torch.randn(sum(grid_sizes), 32)
    with torch.no_grad():
        out = model(x, cu_seqlens, cu_window_seqlens)
    print("fixed" if FIXED else "buggy", "vision out sum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
