"""A hand-written vision tower given `image_grid_thw` (three images) and an additive float mask built from it.

Bug: the loop that opens each image's block writes `mask[:end, :end] = 0`, the whole prefix up to the image's end,
so every image sees the images before it. Fixed (--fixed): `mask[start:end, start:end] = 0`, one block per image."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, bias):
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        return x + self.out(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias)[0]
                            .transpose(0, 1).reshape(n, d))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, pixel_values, image_grid_thw=None):
        x = self.embed(pixel_values)
        ends = image_grid_thw.prod(-1).cumsum(0).tolist()
        bias = torch.full((x.shape[0], x.shape[0]), float("-inf"))
        start = 0
        for end in ends:
            if FIXED:
                bias[start:end, start:end] = 0
            else:
                bias[:end, :end] = 0
            start = end
        for block in self.blocks:
            x = block(x, bias)
        return x


torch.manual_seed(0)
grid = torch.tensor([[1, 2, 3], [1, 2, 2], [1, 3, 3]])
with torch.no_grad():
    print(Tower()(torch.randn(int(grid.prod(-1).sum()), 12), image_grid_thw=grid).shape)
