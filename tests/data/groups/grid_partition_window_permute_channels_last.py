"""MaxViT's grid attention written another way: channels last, a `partition_size` module attribute, an 8 x 12 map and
SDPA. The grid view (B, g, H // g, g, W // g, C) is right, but the permute copied from the window partition,
(0, 1, 3, 2, 4, 5), keeps the grid cell outermost, so each group of g * g tokens is a run of the (H // g) x (W // g)
cell's positions, not one token of each grid cell (ChristophReich1996/MaxViT#2's grid laid out as blocks, here a
permute typo). --fixed permutes (0, 2, 4, 1, 3, 5): each group holds the tokens H // g and W // g apart.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def grid_partition(x, g):
    b, h, w, c = x.shape
    x = x.view(b, g, h // g, g, w // g, c)
    order = (0, 2, 4, 1, 3, 5) if FIXED else (0, 1, 3, 2, 4, 5)
    return x.permute(*order).reshape(-1, g * g, c)


def grid_unpartition(groups, g, b, h, w):
    c = groups.shape[-1]
    if FIXED:
        x = groups.view(b, h // g, w // g, g, g, c).permute(0, 3, 1, 4, 2, 5)
    else:
        x = groups.view(b, g, g, h // g, w // g, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


class GridAttention(nn.Module):
    def __init__(self, dim, partition_size=2, heads=2):
        super().__init__()
        self.partition_size, self.heads = partition_size, heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        y = self.norm(x)
        groups = grid_partition(y, self.partition_size)
        n = groups.shape[1]
        q, k, v = self.qkv(groups).view(-1, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.proj(out.transpose(1, 2).reshape(-1, n, c))
        return x + grid_unpartition(out, self.partition_size, b, h, w)


def main():
    torch.manual_seed(0)
    block = GridAttention(16).eval()
    x = torch.randn(2, 8, 12, 16)
    with torch.no_grad():
        out = block(x)
        nudged = x.clone()
        nudged[:, 0, 0] += 1.0
        changed = (block(nudged) - out).abs().amax(dim=(0, 3)) > 1e-6
    print("cells that read cell (0, 0):", torch.nonzero(changed).tolist())


if __name__ == "__main__":
    main()
