"""A vision encoder that builds cu_seqlens inside its forward and hands them to each block by keyword.

Bug: the eager block turns cu_seqlens into an additive mask whose blocks reach one key past their end
(cu[i] + 1): the last query of each image sees the first key of the next. Fix: the
blocks end at cu[i]. The encoder's caller gives it only the images' sizes; the documents are the blocks' argument.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, cu_seqlens=None):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (1, heads, n, 4) each
        n = x.shape[0]
        mask = torch.full((n, n), float("-inf"))
        for i in range(1, len(cu_seqlens)):
            a, b = int(cu_seqlens[i - 1]), int(cu_seqlens[i]) + (0 if FIXED else 1)
            mask[a:b, a:b] = 0
        weights = torch.softmax(q @ k.transpose(-1, -2) / 2 + mask, dim=-1)
        return x + (weights @ v)[0].transpose(0, 1).reshape(n, 8)


class VisionEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, patches, sizes):
        cu = nn.functional.pad(torch.cumsum(sizes, 0), (1, 0)).to(torch.int32)
        for block in self.blocks:
            patches = block(patches, cu_seqlens=cu)
        return patches


torch.manual_seed(0)
with torch.no_grad():
    out = VisionEncoder()(torch.randn(9, 8), torch.tensor([4, 3, 2]))
print("done", tuple(out.shape))
