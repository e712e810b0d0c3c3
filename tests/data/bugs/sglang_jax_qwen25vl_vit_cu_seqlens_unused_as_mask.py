# sgl-project/sglang-jax#1289: the Qwen2.5-VL vision tower computed cu_seqlens / cu_window_seqlens but used
# them only as a flag: full-attention blocks ran with no mask (patches of different images attended to each
# other) and windowed blocks used a 1-D distance mask |i - j| <= window instead of per-window blocks.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EMBED, HEADS, DEPTH = 32, 4, 4
FULLATT_BLOCK_INDEXES = [1, 3]
WINDOW = 2  # window side, in patches


def segment_mask(cu):
    seg = torch.zeros(int(cu[-1]), dtype=torch.long)
    for i in range(1, len(cu)):
        seg[cu[i - 1]:cu[i]] = i
    return seg[:, None] == seg[None, :]


class Qwen2_5_VLVisionAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens, window=None):
        L, D = x.shape
        q, k, v = self.qkv(x).view(L, 3, self.heads, D // self.heads).permute(1, 2, 0, 3)
        if FIXED:
            mask = segment_mask(cu_seqlens)
        elif window is not None:
            pos = torch.arange(L)
            mask = (pos[:, None] - pos[None, :]).abs() <= window
        else:
            mask = None  # cu_seqlens is only checked for truthiness
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return self.proj(out.transpose(0, 1).reshape(L, D))


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(EMBED)
        self.norm2 = nn.LayerNorm(EMBED)
        self.attn = Qwen2_5_VLVisionAttention(EMBED, HEADS)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 2 * EMBED), nn.GELU(), nn.Linear(2 * EMBED, EMBED))

    def forward(self, x, cu_seqlens, window=None):
        x = x + self.attn(self.norm1(x), cu_seqlens, window)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(12, EMBED)
        self.blocks = nn.ModuleList(Qwen2_5_VLVisionBlock() for _ in range(DEPTH))

    def get_window_index(self, grid_thw):
        window_index, cu_window_seqlens, offset = [], [0], 0
        for t, h, w in grid_thw.tolist():
            idx = torch.arange(t * h * w).view(t, h // WINDOW, WINDOW, w // WINDOW, WINDOW)
            idx = idx.permute(0, 1, 3, 2, 4).reshape(-1)
            window_index.append(idx + offset)
            for _ in range(t * (h // WINDOW) * (w // WINDOW)):
                cu_window_seqlens.append(cu_window_seqlens[-1] + WINDOW * WINDOW)
            offset += t * h * w
        return torch.cat(window_index), torch.tensor(cu_window_seqlens)

    def forward(self, pixel_values, grid_thw):
        x = self.patch_embed(pixel_values)
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        x = x[window_index]
        cu_seqlens = F.pad(torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0), (1, 0))
        for i, blk in enumerate(self.blocks):
            if i in FULLATT_BLOCK_INDEXES:
                x = blk(x, cu_seqlens)
            else:
                x = blk(x, cu_window_seqlens, window=WINDOW * WINDOW)
        return x[torch.argsort(window_index)]


def main():
    model = Qwen2_5_VisionTransformer().eval()
    grid_thw = torch.tensor([[1, 4, 4], [2, 4, 4]])  # one image and a two-frame video, packed
    n = [int(t * h * w) for t, h, w in grid_thw.tolist()]
    pixel_values = torch.randn(sum(n), 12)
    with torch.no_grad():
        out = model(pixel_values, grid_thw)
        ref = model(pixel_values[:n[0]], grid_thw[:1])
    print(f"{'fixed' if FIXED else 'buggy'}: image tokens, packed vs alone: max diff {(out[:n[0]] - ref).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
