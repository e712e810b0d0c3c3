"""A Swin block with a stated shift of 1 whose mask is built for the default half-window shift.

Written for maskcli's tests, channel-last as microsoft/Swin-Transformer writes it, but attending through SDPA with a
bool `attn_mask` (True = attend) of shape (nW, N, N) broadcast over the batch. The block rolls its map by
`shift_size` = 1, yet `region_mask` cuts the regions at `window_size // 2` (the shift every Swin config uses), so
tokens the roll brought together from opposite edges attend to each other. Fixed: the cuts at `shift_size`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def windows_of(x, size):
    b, h, w, c = x.shape
    return x.view(b, h // size, size, w // size, size, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, size * size, c)


class WindowAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attn_mask=None):
        n_windows_b, n, c = x.shape
        q, k, v = self.qkv(x).view(n_windows_b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if attn_mask is not None:  # (nW, N, N) -> one per window of each image
            attn_mask = attn_mask.repeat(n_windows_b // attn_mask.shape[0], 1, 1)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(n_windows_b, n, c)


class ShiftedBlock(nn.Module):
    def __init__(self, dim=16, heads=2, input_resolution=(12, 12), window_size=6, shift_size=1):
        super().__init__()
        self.input_resolution, self.window_size, self.shift_size = input_resolution, window_size, shift_size
        self.attn = WindowAttention(dim, heads)
        self.register_buffer("region", self.region_mask(), persistent=False)

    def region_mask(self):
        h, w = self.input_resolution
        cut = self.shift_size if FIXED else self.window_size // 2
        labels = torch.zeros(1, h, w, 1)
        spans = (slice(0, -self.window_size), slice(-self.window_size, -cut), slice(-cut, None))
        for i, hs in enumerate(spans):
            for j, ws in enumerate(spans):
                labels[:, hs, ws, :] = 3 * i + j
        per_window = windows_of(labels, self.window_size).squeeze(-1)  # (nW, N)
        return per_window[:, :, None] == per_window[:, None, :]

    def forward(self, x):
        b, h, w, c = x.shape
        rolled = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        out = self.attn(windows_of(rolled, self.window_size), attn_mask=self.region)
        out = out.view(b, h // self.window_size, w // self.window_size, self.window_size, self.window_size, c)
        out = out.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return x + torch.roll(out, shifts=(self.shift_size, self.shift_size), dims=(1, 2))


if __name__ == "__main__":
    torch.manual_seed(0)
    with torch.no_grad():
        y = ShiftedBlock().eval()(torch.randn(2, 12, 12, 16))
    print("block output", tuple(y.shape))
