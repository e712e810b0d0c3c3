"""A Swin block (channels last) over a 6 x 6 token map with window 4 and shift 2, so its map is padded to 8 x 8: it
rolls the map by -shift first and pads it after, while its mask labels the regions on the padded 8 x 8 map, where the
wrapped rows and columns would be the last ones; after the roll they sit at 4-5, before the padding. --fixed: the map
padded first and rolled after (the mask then marks the tokens the roll brought together)."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def windows_of(x, window):
    b, h, w, c = x.shape
    return x.view(b, h // window, window, w // window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def merge(windows, window, h, w):
    b = windows.shape[0] // ((h // window) * (w // window))
    return windows.view(b, h // window, w // window, window, window, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


class ShiftedBlock(torch.nn.Module):
    def __init__(self, dim=8, heads=2, window_size=4, shift_size=2):
        super().__init__()
        self.heads, self.window_size, self.shift_size = heads, window_size, shift_size
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def region_mask(self, height, width):
        labels = torch.zeros(1, height, width, 1)
        count = 0
        cuts = (slice(0, -self.window_size), slice(-self.window_size, -self.shift_size), slice(-self.shift_size, None))
        for h in cuts:
            for w in cuts:
                labels[:, h, w, :] = count
                count += 1
        flat = windows_of(labels, self.window_size).squeeze(-1)
        return (flat[:, None, :] - flat[:, :, None]).ne(0).float().mul(-100.0)

    def forward(self, x):
        b, h, w, c = x.shape
        pad_h, pad_w = (-h) % self.window_size, (-w) % self.window_size
        if FIXED:
            padded = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
            shifted = torch.roll(padded, (-self.shift_size, -self.shift_size), dims=(1, 2))
        else:
            rolled = torch.roll(x, (-self.shift_size, -self.shift_size), dims=(1, 2))
            shifted = F.pad(rolled, (0, 0, 0, pad_w, 0, pad_h))
        hp, wp = shifted.shape[1], shifted.shape[2]
        mask = self.region_mask(hp, wp)
        tokens = windows_of(shifted, self.window_size)
        n = tokens.shape[1]
        q, k, v = self.qkv(tokens).view(-1, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        scores = scores.view(b, -1, self.heads, n, n) + mask[None, :, None]
        attended = (scores.view(-1, self.heads, n, n).softmax(-1) @ v).transpose(1, 2).reshape(-1, n, c)
        out = merge(attended, self.window_size, hp, wp)
        if FIXED:
            out = torch.roll(out, (self.shift_size, self.shift_size), dims=(1, 2))[:, :h, :w]
        else:
            out = torch.roll(out[:, :h, :w], (self.shift_size, self.shift_size), dims=(1, 2))
        return x + out


torch.manual_seed(0)
with torch.no_grad():
    y = ShiftedBlock()(torch.randn(2, 6, 6, 8))
print("out norm:", round(y.norm().item(), 4))
