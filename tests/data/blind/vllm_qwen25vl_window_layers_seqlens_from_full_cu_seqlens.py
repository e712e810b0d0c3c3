"""vLLM Qwen2.5-VL vision tower: window-attention layers reuse seqlens pre-computed from full cu_seqlens.

Citation: vllm-project/vllm#15200 "[Bugfix] Fix incorrect qwen2.5-vl attention mask pre-computation"
(opened 2025-03-20, merged; fixes vllm#15122 and vllm#15197; the bug came in with vllm#14377).
Bug: #14377 moved the attention-mask metadata out of the layer loop of
``Qwen2_5_VisionTransformer.forward``: ``max_seqlen`` (FLASH_ATTN) and ``seqlens`` (XFORMERS) were
computed once from the per-frame ``cu_seqlens`` and handed to every block, while the window
layers were given ``cu_window_seqlens``. On the xFormers backend the mask is
``BlockDiagonalMask.from_seqlens(seqlens)``, so the window-attention layers attended over the whole
frame instead of their window (users saw ~10% words missing in OCR).
Fix: compute ``max_seqlen`` / ``seqlens`` from ``cu_seqlens_now`` inside the loop, i.e. from the
cu_seqlens the layer actually uses.
Reproduction: the vLLM vision model's structure (blocks in an nn.ModuleList, fullatt_block_indexes,
get_window_index, per-layer cu_seqlens_now), with the xFormers path; xFormers is not installed on CPU so
``BlockDiagonalMask.from_seqlens`` is a small stand-in that materialises the same block-diagonal
mask and calls F.scaled_dot_product_attention (what xformers' memory_efficient_attention computes
with that bias). One image of 16x16 patches, windows of 4x4 merged tokens: window layers 0 and 2 see
64 keys per query after the fix, 256 before. I read the PR description and its review diff excerpt.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.attn_bias.BlockDiagonalMask (same semantics, dense)."""

    def __init__(self, seqlens):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls(q_seqlen)

    def materialize(self, total):
        mask = torch.zeros(total, total, dtype=torch.bool)
        start = 0
        for n in self.seqlens:
            mask[start:start + n, start:start + n] = True
            start += n
        return mask


def memory_efficient_attention_forward(q, k, v, attn_bias):
    # q, k, v: (b, s, h, d) as xformers takes them
    mask = attn_bias.materialize(q.shape[1])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


class Qwen2_5_VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, attn_backend="XFORMERS"):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_backend = attn_backend

    def forward(self, x, cu_seqlens, max_seqlen=None, seqlens=None):
        # x: [s, b, c]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [b, s, h, d]
        if self.attn_backend == "XFORMERS":
            attn_bias = BlockDiagonalMask.from_seqlens(q_seqlen=seqlens, kv_seqlen=None)
            context_layer = memory_efficient_attention_forward(q, k, v, attn_bias=attn_bias)
        else:
            raise NotImplementedError(self.attn_backend)
        context_layer = context_layer.reshape(b, s, -1).transpose(0, 1)
        return self.proj(context_layer)


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen2_5_VisionAttention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cu_seqlens, max_seqlen=None, seqlens=None):
        x = x + self.attn(self.norm1(x), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqlens=seqlens)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vision_config):
        super().__init__()
        self.hidden_size = vision_config.hidden_size
        self.patch_size = vision_config.patch_size
        self.spatial_merge_size = vision_config.spatial_merge_size
        self.spatial_merge_unit = self.spatial_merge_size ** 2
        self.window_size = vision_config.window_size
        self.fullatt_block_indexes = vision_config.fullatt_block_indexes
        self.attn_backend = "XFORMERS"
        self.blocks = nn.ModuleList(
            [Qwen2_5_VisionBlock(vision_config.hidden_size, vision_config.num_heads) for _ in range(vision_config.depth)])

    def get_window_index(self, grid_thw):
        window_index, cu_window_seqlens, window_index_id = [], [0], 0
        vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
        for grid_t, grid_h, grid_w in grid_thw.tolist():
            llm_grid_h, llm_grid_w = grid_h // self.spatial_merge_size, grid_w // self.spatial_merge_size
            index = torch.arange(grid_t * llm_grid_h * llm_grid_w).reshape(grid_t, llm_grid_h, llm_grid_w)
            pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
            pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
            num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
            num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
            index_padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            index_padded = index_padded.reshape(grid_t, num_windows_h, vit_merger_window_size, num_windows_w,
                                                vit_merger_window_size)
            index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
                grid_t, num_windows_h * num_windows_w, vit_merger_window_size, vit_merger_window_size)
            seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
            index_padded = index_padded.reshape(-1)
            window_index.append(index_padded[index_padded != -100] + window_index_id)
            cu_window_seqlens.extend((seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]).tolist())
            window_index_id += grid_t * llm_grid_h * llm_grid_w
        return torch.cat(window_index, dim=0), cu_window_seqlens

    def forward(self, x, grid_thw):
        hidden_states = x
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens, dtype=torch.int32))
        seq_len, _ = hidden_states.size()
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        hidden_states = hidden_states[window_index, :, :].reshape(seq_len, -1)

        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), "constant", 0)

        hidden_states = hidden_states.unsqueeze(1)  # [s, 1, c]

        max_seqlen = None
        seqlens = None
        if not FIXED:
            # pre-computed once for all layers (vllm#14377)
            if self.attn_backend == "FLASH_ATTN":
                max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
            elif self.attn_backend == "XFORMERS":
                seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        for layer_num, blk in enumerate(self.blocks):
            if layer_num in self.fullatt_block_indexes:
                cu_seqlens_now = cu_seqlens
            else:
                cu_seqlens_now = cu_window_seqlens
            if FIXED:
                if self.attn_backend == "FLASH_ATTN":
                    max_seqlen = (cu_seqlens_now[1:] - cu_seqlens_now[:-1]).max().item()
                elif self.attn_backend == "XFORMERS":
                    seqlens = (cu_seqlens_now[1:] - cu_seqlens_now[:-1]).tolist()
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now, max_seqlen=max_seqlen, seqlens=seqlens)

        hidden_states = hidden_states.squeeze(1)
        reverse_indices = torch.argsort(window_index)
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        return hidden_states[reverse_indices, :, :].reshape(seq_len, -1)


def main():
    torch.manual_seed(0)
    vision_config = SimpleNamespace(depth=4, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2,
                                    window_size=112, fullatt_block_indexes=[1, 3])
    model = Qwen2_5_VisionTransformer(vision_config).eval()
    grid_thw = torch.tensor([[1, 16, 16]])
    x = torch.randn(int(grid_thw.prod(-1).sum()), vision_config.hidden_size)
    with torch.no_grad():
        out = model(x, grid_thw)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
