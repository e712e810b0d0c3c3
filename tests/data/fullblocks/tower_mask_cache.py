"""A Qwen2.5-VL-like vision tower whose attention masks are cached by sequence length, not by segments.

Bug: the tower builds each block's additive mask from its cu_seqlens once and caches it under the token count, so the
full-attention block (fullatt_block_indexes) reuses the windowed blocks' mask. --fixed: cache by the segments.
--inside: the window segments are cut inside forward (not handed to the model call). --one-window: each image fits
in one window (the window segments are the image's), where full and windowed blocks rightly share one mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class VisionConfig:
    dim: int = 16
    heads: int = 2
    depth: int = 3
    fullatt_block_indexes: tuple = (1,)
    window_tokens: int = 8


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)

    def forward(self, x, bias):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).permute(1, 2, 0, 3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(0, 1).reshape(n, -1)


class Tower(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Attention(cfg) for _ in range(cfg.depth))
        self.fullatt_block_indexes = list(cfg.fullatt_block_indexes)
        self._masks = {}

    def bias(self, cu, n):
        key = tuple(cu.tolist()) if FIXED else n
        if key not in self._masks:
            seg = torch.bucketize(torch.arange(n), cu[1:], right=True)
            self._masks[key] = torch.where(seg[:, None] == seg[None, :], 0.0, float("-inf"))
        return self._masks[key]

    def forward(self, x, cu_seqlens, cu_window_seqlens=None):
        if cu_window_seqlens is None:  # --inside: windows of window_tokens cut in each image
            ends = [e for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
                    for e in range(a + self.cfg.window_tokens, b, self.cfg.window_tokens)] + cu_seqlens[1:].tolist()
            cu_window_seqlens = torch.tensor([0] + sorted(ends))
        for i, blk in enumerate(self.layers):
            cu = cu_seqlens if i in self.fullatt_block_indexes else cu_window_seqlens
            x = x + blk(x, self.bias(cu, x.shape[0]))
        return x


def main():
    torch.manual_seed(0)
    cfg = VisionConfig()
    tower = Tower(cfg).eval()
    if "--one-window" in sys.argv:
        cu, window = torch.tensor([0, 8, 14]), torch.tensor([0, 8, 14])
    else:
        cu, window = torch.tensor([0, 16, 24]), torch.tensor([0, 8, 16, 24])
    x = torch.randn(int(cu[-1]), cfg.dim)
    with torch.no_grad():
        out = tower(x, cu) if "--inside" in sys.argv else tower(x, cu, cu_window_seqlens=window)
    print("out", round(out.sum().item(), 3))


if __name__ == "__main__":
    main()
