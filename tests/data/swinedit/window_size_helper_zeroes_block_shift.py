"""A shifted-window block written as Video Swin writes its `get_window_size(x_size, window_size, shift_size)`, but
without the `list(shift_size)` copy: the helper zeroes the shift of every axis the window covers in the list it was
handed, which is the block's own `self.shift_size`. A first call on a 4 x 4 map (one window: the shift is moot there)
leaves the block at [0, 0], and the next map, 8 x 12 (2 x 3 windows), runs with no roll and no mask into SDPA, as a
plain W-MSA block (pytorch/vision#6266's in-place edit, here in a helper, non-square, bool SDPA mask when shifted).
--fixed copies the list first.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def get_window_size(x_size, window_size, shift_size):
    use_window_size = list(window_size)
    use_shift_size = list(shift_size) if FIXED else shift_size
    for i in range(len(x_size)):
        if x_size[i] <= window_size[i]:
            use_window_size[i] = x_size[i]
            use_shift_size[i] = 0
    return tuple(use_window_size), tuple(use_shift_size)


def window_partition(x, window):
    b, h, w, c = x.shape
    x = x.view(b, h // window[0], window[0], w // window[1], window[1], c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window[0] * window[1], c)


def window_reverse(windows, window, b, h, w):
    x = windows.view(b, h // window[0], w // window[1], window[0], window[1], -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def compute_mask(h, w, window, shift):
    """(nW, N, N) bool, True = may attend: tokens of one region of the rolled map."""
    img_mask = torch.zeros(1, h, w, 1)
    count = 0
    for rows in (slice(-window[0]), slice(-window[0], -shift[0]), slice(-shift[0], None)):
        for cols in (slice(-window[1]), slice(-window[1], -shift[1]), slice(-shift[1], None)):
            img_mask[:, rows, cols, :] = count
            count += 1
    labels = window_partition(img_mask, window)[..., 0]
    return labels[:, :, None] == labels[:, None, :]


class SwinBlock(nn.Module):
    def __init__(self, dim, num_heads=2, window_size=(4, 4), shift_size=None):
        super().__init__()
        self.num_heads, self.window_size = num_heads, window_size
        self.shift_size = shift_size if shift_size is not None else [w // 2 for w in window_size]
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        window, shift = get_window_size((h, w), self.window_size, self.shift_size)
        y = self.norm(x)
        if any(s > 0 for s in shift):
            y = torch.roll(y, shifts=(-shift[0], -shift[1]), dims=(1, 2))
            mask = compute_mask(h, w, window, shift)
        else:
            mask = None
        windows = window_partition(y, window)
        nw, n = windows.shape[0] // b, windows.shape[1]
        q, k, v = self.qkv(windows).view(-1, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        keep = None if mask is None else mask.repeat(b, 1, 1)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        out = self.proj(out.transpose(1, 2).reshape(b * nw, n, c))
        y = window_reverse(out, window, b, h, w)
        if any(s > 0 for s in shift):
            y = torch.roll(y, shifts=shift, dims=(1, 2))
        return x + y


def main():
    torch.manual_seed(0)
    block = SwinBlock(16).eval()
    with torch.no_grad():
        block(torch.randn(1, 4, 4, 16))
        out = block(torch.randn(2, 8, 12, 16))
    print("shift after the small map:", block.shift_size, tuple(out.shape))


if __name__ == "__main__":
    main()
