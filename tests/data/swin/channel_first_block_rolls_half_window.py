"""A channel-first shifted-window block (a restoration network's port, Uformer / SwinIR style, on (B, C, H, W) maps)
whose roll uses half the window while its config states a shift of 1.

Written for maskcli's tests. The block states `shift_size` = 1 and builds Swin's region mask for it (cuts at
-window and -shift_size along both axes, additive -inf over an einsum softmax), but its forward rolls the map by
`window_size // 2` = 2, the shift most Swin configs use, so the tokens the roll brought together from the map's
opposite edges are not the ones the mask keeps apart. Fixed: the roll by shift_size.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def to_windows(x, size):
    """(B, C, H, W) -> (B * nW, size * size, C), windows row-major, tokens row-major in each."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // size, size, w // size, size).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(-1, size * size, c)


def from_windows(windows, size, b, c, h, w):
    x = windows.view(b, h // size, w // size, size, size, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, h, w)


class LeWinBlock(nn.Module):
    def __init__(self, dim=8, heads=2, input_resolution=(8, 8), window_size=4, shift_size=1):
        super().__init__()
        self.input_resolution, self.window_size, self.shift_size = input_resolution, window_size, shift_size
        self.heads = heads
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.register_buffer("mask", self.shift_mask(), persistent=False)

    def shift_mask(self):
        h, w = self.input_resolution
        s, ws = self.shift_size, self.window_size
        img = torch.zeros(1, 1, h, w)
        count = 0
        for hs in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            for wsl in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
                img[:, :, hs, wsl] = count
                count += 1
        ids = to_windows(img, ws).squeeze(-1)  # (nW, N)
        diff = ids[:, None, :] - ids[:, :, None]
        return torch.zeros_like(diff).masked_fill(diff != 0, float("-inf"))  # (nW, N, N), additive

    def forward(self, x):
        b, c, h, w = x.shape
        step = self.shift_size if FIXED else self.window_size // 2
        shifted = torch.roll(x, shifts=(-step, -step), dims=(2, 3))
        qkv = to_windows(self.qkv(shifted), self.window_size)  # (B * nW, N, 3C)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
        n_windows = self.mask.shape[0]
        scores = scores.view(b, n_windows, self.heads, *scores.shape[-2:]) + self.mask[None, :, None]
        probs = scores.view(-1, self.heads, *scores.shape[-2:]).softmax(dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v).transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], c)
        out = torch.roll(from_windows(out, self.window_size, b, c, h, w), shifts=(step, step), dims=(2, 3))
        return x + self.proj(out)


if __name__ == "__main__":
    torch.manual_seed(0)
    with torch.no_grad():
        y = LeWinBlock().eval()(torch.randn(2, 8, 8, 8))
    print("block output", tuple(y.shape))
