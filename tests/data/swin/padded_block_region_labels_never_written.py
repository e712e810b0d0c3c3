# Written another way (checks/swin.py, as Uformer's LeWin block before ZhendongWang6/Uformer c715ca5): a SwinIR-style
# channel-last block over a 10x10 map padded to 12x12, windows of 6 shifted by 3, its bool SDPA mask built by a helper
# whose region loop rebinds a name instead of writing the label map, so every token carries label 0: the shifted
# windows' mask keeps every pair, and tokens the cyclic roll brought from opposite edges attend each other.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def partition(x: torch.Tensor, size: int) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // size, size, w // size, size, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, size * size, c)


def merge(windows: torch.Tensor, size: int, h: int, w: int) -> torch.Tensor:
    b = windows.shape[0] // ((h // size) * (w // size))
    x = windows.view(b, h // size, w // size, size, size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def region_labels(height: int, width: int, window: int, shift: int) -> torch.Tensor:
    labels = torch.zeros(height, width, dtype=torch.long)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    count = 0
    for rows in cuts:
        for cols in cuts:
            if FIXED:
                labels[rows, cols] = count
            else:
                region = labels[rows, cols]
                region = torch.full_like(region, count)  # (a new tensor: the label map keeps its zeros)
            count += 1
    return labels


class ShiftedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, input_resolution, window_size: int, shift_size: int):
        super().__init__()
        self.heads, self.input_resolution = heads, input_resolution
        self.window_size, self.shift_size = window_size, shift_size
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def window_mask(self, height: int, width: int) -> torch.Tensor:
        labels = partition(region_labels(height, width, self.window_size, self.shift_size)[None, :, :, None],
                           self.window_size)[..., 0]  # (nW, N)
        return labels[:, :, None] == labels[:, None, :]  # (nW, N, N), True = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        pad_h, pad_w = (-h) % self.window_size, (-w) % self.window_size
        padded = F.pad(self.norm(x), (0, 0, 0, pad_w, 0, pad_h))
        hp, wp = h + pad_h, w + pad_w
        shifted = torch.roll(padded, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = partition(shifted, self.window_size)
        attn_mask = self.window_mask(hp, wp).repeat(b, 1, 1)[:, None]  # (B * nW, 1, N, N)
        q, k, v = self.qkv(windows).view(windows.shape[0], -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = self.proj(out.transpose(1, 2).reshape(windows.shape[0], -1, c))
        out = torch.roll(merge(out, self.window_size, hp, wp), shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        return x + out[:, :h, :w]


block = ShiftedBlock(dim=16, heads=2, input_resolution=(10, 10), window_size=6, shift_size=3).eval()
with torch.no_grad():
    x = torch.randn(2, 10, 10, 16)
    y = block(x)
    moved = x.clone()
    moved[:, 0] = torch.randn(2, 10, 16)  # the top row changes: the bottom rows share shifted windows with it, not a region
    z = block(moved)
print(f"block output {tuple(y.shape)}; bottom row moved by a top-row change: {(z - y)[:, -1].abs().max().item():.6f}")
