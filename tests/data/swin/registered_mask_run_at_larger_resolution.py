"""A Swin block written another way: its shifted-window mask is a bool buffer registered in __init__ from the
`input_resolution` it was built for (8x8 patches: 4 windows), as microsoft/Swin-Transformer registers `attn_mask`;
fine-tuned at a larger image (16x16 patches: 16 windows per image), the same 4-window mask is repeated over the
batch's windows and handed to SDPA, so each window gets the mask of another window of another map
(microsoft/esvit#9's multi-crop views given the mask of the init resolution, here a larger map, bool, SDPA, B = 2).
--fixed builds the mask for the map the block is run on (kept per size).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def partition(x, window):
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def merge(windows, window, h, w):
    b = windows.shape[0] // ((h // window) * (w // window))
    x = windows.view(b, h // window, w // window, window, window, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def shifted_keep_mask(h, w, window, shift):
    """(nW, N, N) bool, True = may attend: tokens whose regions of the rolled map are one."""
    labels = torch.zeros(1, h, w, 1)
    count = 0
    for rows in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for cols in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            labels[:, rows, cols, :] = count
            count += 1
    cut = partition(labels, window)[..., 0]
    return cut[:, :, None] == cut[:, None, :]


class ShiftedBlock(nn.Module):
    def __init__(self, dim, input_resolution, window_size=4, shift_size=2, heads=2):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size, self.shift_size, self.heads = window_size, shift_size, heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("attn_mask", shifted_keep_mask(*input_resolution, window_size, shift_size))
        self.masks = {}

    def mask_for(self, h, w):
        if not FIXED:
            return self.attn_mask
        if (h, w) not in self.masks:
            self.masks[h, w] = shifted_keep_mask(h, w, self.window_size, self.shift_size)
        return self.masks[h, w]

    def forward(self, x):
        b, h, w, c = x.shape
        shortcut = x
        x = self.norm(x)
        shifted = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = partition(shifted, self.window_size)
        n = windows.shape[1]
        q, k, v = self.qkv(windows).view(-1, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn_mask = self.mask_for(h, w)
        keep = attn_mask.repeat(windows.shape[0] // attn_mask.shape[0], 1, 1)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        out = self.proj(out.transpose(1, 2).reshape(-1, n, c))
        out = torch.roll(merge(out, self.window_size, h, w), shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        return shortcut + out


def main():
    torch.manual_seed(0)
    block = ShiftedBlock(16, input_resolution=(8, 8)).eval()
    with torch.no_grad():
        pretrain = block(torch.randn(2, 8, 8, 16))
        finetune = block(torch.randn(2, 16, 16, 16))
    print(tuple(pretrain.shape), tuple(finetune.shape))


if __name__ == "__main__":
    main()
