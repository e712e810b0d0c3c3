# vLLM Qwen2.5-VL vision tower, vllm-project/vllm#15200 (regression from #14377).
# The xformers `seqlens` for the BlockDiagonalMask are pre-computed once from the full-attention cu_seqlens and
# passed to every block, so the windowed-attention blocks attend across the whole image instead of one window.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

XFORMERS, TORCH_SDPA = "XFORMERS", "TORCH_SDPA"


class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.attn_bias.BlockDiagonalMask (xformers is not installed here)."""

    def __init__(self, seqlens):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, device=None):
        return cls(q_seqlen)

    def materialize(self):
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(self.seqlens)])
        return ids[:, None] == ids[None, :]


def memory_efficient_attention_forward(q, k, v, attn_bias=None, p=0.0, scale=None):
    # (b, s, h, d) layout, dense equivalent of xformers' block-diagonal bias
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias.materialize())
    return out.transpose(1, 2)


class Qwen2_5_VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, attn_backend):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_backend = attn_backend

    def forward(self, x, cu_seqlens, max_seqlen: Optional[int] = None, seqlens: Optional[list] = None):
        # x: [s, b, c]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # b s h d
        if self.attn_backend == TORCH_SDPA:
            outputs = []
            for i in range(1, len(cu_seqlens)):
                start_idx, end_idx = cu_seqlens[i - 1], cu_seqlens[i]
                q_i, k_i, v_i = (t[:, start_idx:end_idx].transpose(1, 2) for t in (q, k, v))
                output_i = F.scaled_dot_product_attention(q_i, k_i, v_i, dropout_p=0.0)
                outputs.append(output_i.transpose(1, 2))
            context_layer = torch.cat(outputs, dim=1)
        elif self.attn_backend == XFORMERS:
            if seqlens is None:
                seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            attn_bias = BlockDiagonalMask.from_seqlens(q_seqlen=seqlens, kv_seqlen=None, device=q.device)
            context_layer = memory_efficient_attention_forward(q, k, v, attn_bias=attn_bias, p=0, scale=None)
        context_layer = context_layer.transpose(0, 1).reshape(s, b, -1)
        return self.proj(context_layer)


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, dim, num_heads, attn_backend):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = Qwen2_5_VisionAttention(dim, num_heads, attn_backend)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cu_seqlens, max_seqlen=None, seqlens=None):
        x = x + self.attn(self.norm1(x), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqlens=seqlens)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, attn_backend, dim=32, num_heads=4, depth=4, patch_size=2, spatial_merge_size=2,
                 window_size=8, fullatt_block_indexes=(1, 3)):
        super().__init__()
        self.attn_backend = attn_backend
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.spatial_merge_unit = spatial_merge_size ** 2
        self.window_size = window_size
        self.fullatt_block_indexes = list(fullatt_block_indexes)
        self.blocks = nn.ModuleList(Qwen2_5_VisionBlock(dim, num_heads, attn_backend) for _ in range(depth))

    def get_window_index(self, grid_thw):
        window_index: list = []
        cu_window_seqlens: list = [0]
        window_index_id = 0
        vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
        for grid_t, grid_h, grid_w in grid_thw:
            llm_grid_h = grid_h // self.spatial_merge_size
            llm_grid_w = grid_w // self.spatial_merge_size
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
            index_new = index_padded[index_padded != -100]
            window_index.append(index_new + window_index_id)
            cu_seqlens_tmp = seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]
            cu_window_seqlens.extend(cu_seqlens_tmp.tolist())
            window_index_id += (grid_t * llm_grid_h * llm_grid_w).item()
        return torch.cat(window_index, dim=0), cu_window_seqlens

    def forward(self, x, grid_thw):
        # x: (seq_len, dim) patch embeddings (patch_embed / rotary embedding omitted)
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens, dtype=torch.int32))
        seq_len, _ = x.size()
        x = x.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        x = x[window_index, :, :].reshape(seq_len, -1)

        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), "constant", 0)

        x = x.unsqueeze(1)
        max_seqlen = None
        seqlens = None
        if not FIXED:
            # pre-compute seqlens for attn mask to reduce cuMemcpy operations (#14377)
            if self.attn_backend == XFORMERS:
                seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        for layer_num, blk in enumerate(self.blocks):
            if layer_num in self.fullatt_block_indexes:
                cu_seqlens_now = cu_seqlens
            else:
                cu_seqlens_now = cu_window_seqlens
            x = blk(x, cu_seqlens=cu_seqlens_now, max_seqlen=max_seqlen, seqlens=seqlens)

        x = x.squeeze(1).reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        reverse_indices = torch.argsort(window_index)
        return x[reverse_indices, :].reshape(seq_len, -1)


xf = Qwen2_5_VisionTransformer(XFORMERS).eval()
sd = Qwen2_5_VisionTransformer(TORCH_SDPA).eval()
sd.load_state_dict(xf.state_dict())
grid_thw = torch.tensor([[1, 8, 12], [1, 4, 8]])  # two images, 96 + 32 patches, windows of 4x4 patches
x = torch.randn(int((grid_thw.prod(-1)).sum()), 32)
with torch.no_grad():
    out_xf = xf(x, grid_thw)
    out_sd = sd(x, grid_thw)
print(f"max |xformers-backend output - torch-sdpa-backend output| = {(out_xf - out_sd).abs().max().item():.6f}")
