# Written another way (the bug of lucidrains/vit-pytorch c2b2db2): a hierarchical ViT whose stages attend in windows,
# channels last (B, H, W, C), through F.scaled_dot_product_attention. Its last stage is built with `window_size=None`,
# global attention over the whole map; the window partition falls back to `min(H, W)` for a missing size, so on a tall
# map (H = 2W) it cuts the map into two square windows and each query sees half of its image. The fix partitions a
# None window as the whole (H, W) map.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def partition(x, wh, ww):
    """(B, H, W, C) -> (B * nH * nW, wh * ww, C), windows row-major."""
    B, H, W, C = x.shape
    x = x.view(B, H // wh, wh, W // ww, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, C)


def merge(windows, B, H, W, wh, ww):
    C = windows.shape[-1]
    x = windows.view(B, H // wh, W // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


class WindowAttention(nn.Module):
    def __init__(self, dim, heads, window_size=None):
        super().__init__()
        self.heads, self.window_size = heads, window_size
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, C = x.shape
        if self.window_size is not None:
            wh = ww = self.window_size
        elif FIXED:
            wh, ww = H, W  # no window: the whole map
        else:
            wh = ww = min(H, W)  # no window given: the largest square that fits
        windows = partition(x, wh, ww)
        n, L, _ = windows.shape
        q, k, v = self.qkv(windows).view(n, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, L, C)
        return merge(self.proj(out), B, H, W, wh, ww)


class Stage(nn.Module):
    def __init__(self, dim, heads, window_size):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window_size)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class HierViT(nn.Module):
    def __init__(self, dims=(16, 32), heads=(2, 4), windows=(4, None), classes=10):
        super().__init__()
        self.embed = nn.Conv2d(3, dims[0], 4, stride=4)
        self.stages = nn.ModuleList([Stage(d, h, w) for d, h, w in zip(dims, heads, windows)])
        self.down = nn.Linear(4 * dims[0], dims[1])
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, img):
        x = self.embed(img).permute(0, 2, 3, 1)  # (B, H, W, C)
        x = self.stages[0](x)
        B, H, W, C = x.shape
        x = x.view(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H // 2, W // 2, 4 * C)
        x = self.stages[1](self.down(x))
        return self.head(x.mean(dim=(1, 2)))


model = HierViT()
imgs = torch.randn(3, 3, 64, 32)  # tall images: maps 16x8, then 8x4
logits = model(imgs)
loss = F.cross_entropy(logits, torch.tensor([0, 4, 9]))
loss.backward()
print("fixed" if FIXED else "buggy", "loss %.5f" % loss.item())
