"""SGLang Qwen3-VL vision tower: cu_seqlens per video instead of per frame, so frames attend each other.

Citation: sgl-project/sglang#11458 "[BugFix][Qwen3-VL]: fix cu_seqlens in qwen3-vl" (opened 2025-10-11, merged);
the same fix was proposed for SGLang's Qwen2.5-VL in sgl-project/sglang#12261.
Bug (PR description): "The implementation of cu_seqlens is inconsistent with the HF implementation,
resulting in accuracy issues with multi-frame/multi-patch inputs." SGLang built
``cu_seqlens = cat([0], (grid_t * grid_h * grid_w).cumsum())`` (then ``F.pad`` one more 0), i.e. one
attention segment per image/video item; HF builds one segment per temporal frame with
``repeat_interleave(grid_h * grid_w, grid_t)``, so in the model's vision encoder the patches of one
frame never attend to another frame's patches.
Fix: ``cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0)``
then ``F.pad(cu_seqlens, (1, 0), value=0)``.
Reproduction: SGLang's model layout (Qwen3_VisionTransformer -> Qwen3_VisionBlock -> VisionAttention
with the "sdpa" qkv backend and flatten_batch, whose mask is block-diagonal over cu_seqlens and is
passed to F.scaled_dot_product_attention). Inputs: one video with grid_t=2 (two temporal patches of
4x4) and one 4x4 image. I read the PR descriptions; the pre-fix expression is the one in SGLang's
Qwen2.5-VL file that #12261 replaces (I could not read #11458's diff itself).
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class VisionSdpaAttention(nn.Module):
    """SGLang's sdpa qkv backend: one block-diagonal mask over the flattened batch."""

    def __init__(self, head_dim, num_heads, flatten_batch=True):
        super().__init__()
        self.head_size = head_dim
        self.num_heads = num_heads
        self.flatten_batch = flatten_batch

    @staticmethod
    def _generate_mask_cache(s, flatten_batch, cu_seqlens):
        if flatten_batch:
            mask = torch.zeros([1, s, s], dtype=torch.bool)
            for i in range(1, len(cu_seqlens)):
                start = cu_seqlens[i - 1]
                end = cu_seqlens[i]
                mask[..., start:end, start:end] = True
            return mask
        raise NotImplementedError

    def forward(self, q, k, v, bsz, cu_seqlens):
        # q, k, v: (b * s, h, d)
        s = q.shape[0] // bsz
        attention_mask = self._generate_mask_cache(s, self.flatten_batch, cu_seqlens.tolist())
        q, k, v = (x.view(bsz, s, self.num_heads, self.head_size).transpose(1, 2) for x in (q, k, v))
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0)
        return output.transpose(1, 2).reshape(bsz * s, self.num_heads, self.head_size)


class VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = embed_dim // num_heads
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.qkv_backend = VisionSdpaAttention(self.head_size, num_heads, flatten_batch=True)

    def forward(self, x, cu_seqlens):
        bsz, s, _ = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(bsz * s, self.num_heads, self.head_size) for t in (q, k, v))
        output = self.qkv_backend(q, k, v, bsz, cu_seqlens)
        return self.proj(output.reshape(bsz, s, -1))


class Qwen3_VisionBlock(nn.Module):
    def __init__(self, dim, num_heads, intermediate_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, intermediate_dim), nn.GELU(), nn.Linear(intermediate_dim, dim))

    def forward(self, x, cu_seqlens):
        hidden_states = self.norm1(x).transpose(0, 1)  # "s b ... -> b s ..."
        attn = self.attn(hidden_states, cu_seqlens=cu_seqlens).transpose(0, 1)
        x = x + attn
        return x + self.mlp(self.norm2(x))


class Qwen3_VisionTransformer(nn.Module):
    def __init__(self, vision_config):
        super().__init__()
        self.hidden_size = vision_config.hidden_size
        self.spatial_merge_size = vision_config.spatial_merge_size
        self.patch_embed = nn.Linear(vision_config.in_channels * vision_config.temporal_patch_size
                                     * vision_config.patch_size ** 2, vision_config.hidden_size)
        self.blocks = nn.ModuleList([
            Qwen3_VisionBlock(vision_config.hidden_size, vision_config.num_heads, vision_config.intermediate_size)
            for _ in range(vision_config.depth)])

    def forward(self, x, grid_thw):
        x = self.patch_embed(x)
        if FIXED:
            cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
                dim=0, dtype=torch.int32)
            cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)
        else:
            # compute cu_seqlens
            cu_seqlens = torch.cat([
                torch.tensor([0], device=grid_thw.device),
                (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).cumsum(dim=0),
            ])
            cu_seqlens = F.pad(cu_seqlens, (1, 0), "constant", 0)
        x = x.unsqueeze(1)
        for blk in self.blocks:
            x = blk(x, cu_seqlens=cu_seqlens)
        return x.squeeze(1)


def main():
    torch.manual_seed(0)
    vision_config = SimpleNamespace(hidden_size=32, num_heads=4, intermediate_size=64, depth=2, patch_size=2,
                                    temporal_patch_size=2, in_channels=3, spatial_merge_size=2)
    model = Qwen3_VisionTransformer(vision_config).eval()
    grid_thw = torch.tensor([[2, 4, 4], [1, 4, 4]])  # a two-frame video, then an image
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 2 * 2)
    with torch.no_grad():
        out = model(pixel_values, grid_thw)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
