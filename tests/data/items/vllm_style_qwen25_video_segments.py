"""A vLLM-style Qwen2.5-VL vision tower attending one segment per SDPA call (a loop over cu_seqlens), given a
three-frame video and an image in `grid_thw`.

Bug: cu_seqlens from t * h * w per item, so the video's three temporal patches are one segment and see each other.
Fixed (--fixed): `repeat_interleave(h * w, t)`, one segment per temporal patch, as transformers' tower does."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Qwen2_5_VisionAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        outs = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            o = F.scaled_dot_product_attention(q[None, :, start:end], k[None, :, start:end], v[None, :, start:end])
            outs.append(o[0].transpose(0, 1).reshape(end - start, d))
        return self.proj(torch.cat(outs))


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(16), Qwen2_5_VisionAttention()

    def forward(self, x, cu_seqlens):
        return x + self.attn(self.norm(x), cu_seqlens)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(24, 16)
        self.blocks = nn.ModuleList([Qwen2_5_VisionBlock() for _ in range(2)])

    def forward(self, x, grid_thw):
        x = self.patch_embed(x)
        if FIXED:
            sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        else:
            sizes = grid_thw.prod(-1)
        cu_seqlens = F.pad(sizes.cumsum(0), (1, 0))
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return x


torch.manual_seed(0)
grid_thw = torch.tensor([[3, 2, 4], [1, 4, 2]])
with torch.no_grad():
    print(Qwen2_5_VisionTransformer()(torch.randn(int(grid_thw.prod(-1).sum()), 24), grid_thw).shape)
