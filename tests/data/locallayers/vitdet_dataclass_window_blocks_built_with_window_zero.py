# SAM's / ViTDet's windowed blocks run as global attention, written as a ViTDet-style nn.Module backbone: a dataclass
# config (`window_block_indices`, `window_size`, `num_hidden_layers`) kept by the backbone as `self.config`, each block
# built with its own `window_size` (0: global), the blocks in a ModuleList, a batch of 2 images on a 6x6 patch grid
# (zero-padded to 8x8 for 4x4 windows), F.scaled_dot_product_attention. The bug: the backbone builds every block with
# window_size=0 (the per-block choice dropped), so the blocks the config names windowed attend over the whole grid;
# the fix passes config.window_size to the blocks in window_block_indices.
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class BackboneConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 4
    patch_size: int = 4
    image_size: int = 24
    window_size: int = 4
    window_block_indices: list = field(default_factory=lambda: [0, 2])


def window_partition(x, w):
    b, h, wd, c = x.shape
    ph, pw = (w - h % w) % w, (w - wd % w) % w
    x = F.pad(x, (0, 0, 0, pw, 0, ph))
    hp, wp = h + ph, wd + pw
    x = x.view(b, hp // w, w, wp // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
    return x, (hp, wp)


def window_unpartition(x, w, padded, hw):
    hp, wp = padded
    b = x.shape[0] // (hp * wp // w // w)
    x = x.view(b, hp // w, wp // w, w, w, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, -1)
    return x[:, : hw[0], : hw[1]]


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):  # (B, N, C)
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads, window_size):
        super().__init__()
        self.window_size = window_size
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.window_size > 0:
            windows, padded = window_partition(y, self.window_size)
            y = window_unpartition(self.attn(windows), self.window_size, padded, (h, w))
        else:
            y = self.attn(y.reshape(b, h * w, c)).view(b, h, w, c)
        x = x + y
        return x + self.mlp(self.norm2(x))


class Backbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.patch = nn.Conv2d(3, config.hidden_size, config.patch_size, config.patch_size)
        self.blocks = nn.ModuleList(
            Block(config.hidden_size, config.num_attention_heads,
                  config.window_size if FIXED and i in config.window_block_indices else 0)
            for i in range(config.num_hidden_layers))

    def forward(self, pixel_values):
        x = self.patch(pixel_values).permute(0, 2, 3, 1)
        for block in self.blocks:
            x = block(x)
        return x


config = BackboneConfig()
model = Backbone(config).eval()
with torch.no_grad():
    features = model(torch.randn(2, 3, config.image_size, config.image_size))
print(tuple(features.shape), f"{features.norm().item():.4f}")
