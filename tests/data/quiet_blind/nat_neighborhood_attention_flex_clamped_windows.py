"""Neighborhood Attention (NAT) on a 6x10 feature map via FlexAttention: clamped 3x5 windows.

Follows SHI-Labs/Neighborhood-Attention-Transformer classification/nat.py + natten/nattentorch.py
(LegacyNeighborhoodAttention: every pixel attends to a kernel-sized neighborhood; near the border the
window is not cut but shifted inwards, the replicate-pad trick) and pytorch-labs/attention-gym
attn_gym/masks/natten.py (generate_natten: kernel center clamped to kernel//2 from the edge).
Here the canvas is not square (H=6, W=10) and the kernel is 3 (rows) x 5 (cols), so rows and columns
are clamped each with their own size. The mask_mod is compiled into a BlockMask once per canvas.
Mask meant: query pixel (r, c) sees exactly 15 keys: rows |clamp(r, 1, 4) - r'| <= 1 and columns
|clamp(c, 2, 7) - c'| <= 2. Not symmetric at the borders (a corner pixel's window is off-center),
bidirectional, no causality.
"""
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def generate_natten(canvas_h, canvas_w, kernel_h, kernel_w):
    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_r, q_c = q_idx // canvas_w, q_idx % canvas_w
        kv_r, kv_c = kv_idx // canvas_w, kv_idx % canvas_w
        # the window keeps its full size at the border: its center is clamped inwards
        center_r = q_r.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        center_c = q_c.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        return ((center_r - kv_r).abs() <= kernel_h // 2) & ((center_c - kv_c).abs() <= kernel_w // 2)

    natten_mask_mod.__name__ = f"natten_c{canvas_h}x{canvas_w}_k{kernel_h}x{kernel_w}"
    return natten_mask_mod


class NeighborhoodAttention2D(nn.Module):
    def __init__(self, dim, kernel_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.kernel_size = kernel_size
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self._block_masks = {}

    def block_mask(self, H, W):
        if (H, W) not in self._block_masks:
            mask_mod = generate_natten(H, W, *self.kernel_size)
            self._block_masks[(H, W)] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=H * W,
                                                          KV_LEN=H * W, device="cpu")
        return self._block_masks[(H, W)]

    def forward(self, x):
        B, H, W, C = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        out = flex_attention(q, k, v, block_mask=self.block_mask(H, W))
        return self.proj(out.transpose(1, 2).reshape(B, H, W, C))


class NATLayer(nn.Module):
    def __init__(self, dim, num_heads, kernel_size, mlp_ratio=2.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = NeighborhoodAttention2D(dim, kernel_size=kernel_size, num_heads=num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


if __name__ == "__main__":
    # eager CPU flex runs unfused; that is fine for a 60-token canvas
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    layers = nn.Sequential(*[NATLayer(dim=32, num_heads=4, kernel_size=(3, 5)) for _ in range(2)]).eval()
    x = torch.randn(2, 6, 10, 32)  # B, H, W, C (NAT keeps channels last)
    with torch.no_grad():
        y = layers(x)
    print("features", tuple(y.shape))
