"""An Idefics2-style vision tower whose (B, H/p, W/p) patch_attention_mask sets the position ids but never reaches
its nn.MultiheadAttention (the fix hands it over as key_padding_mask, True = padding)."""
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
P = 2  # patch side in pixels


class Tower(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.patch = nn.Linear(3 * P * P, d)
        self.pos = nn.Embedding(16, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, pixel_values, patch_attention_mask):
        b, c, h, w = pixel_values.shape
        patches = pixel_values.unfold(2, P, P).unfold(3, P, P).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * P * P)
        real = patch_attention_mask.flatten(1)  # (B, patches), row-major like the patches
        x = self.patch(patches) + self.pos((real.cumsum(1) - 1).clamp(min=0) * real)
        return self.attn(x, x, x, key_padding_mask=~real if FIXED else None, need_weights=False)[0]


torch.manual_seed(0)
pixels = torch.zeros(2, 3, 6, 6)
pixels[0] = torch.randn(3, 6, 6)
pixels[1, :, :4, :4] = torch.randn(3, 4, 4)  # a 4x4 image padded to 6x6 with zeros
patch_mask = pixels.abs().sum(1).unfold(1, P, P).unfold(2, P, P).sum((-1, -2)) > 0  # (2, 3, 3): True on real patches
with torch.no_grad():
    Tower()(pixels, patch_attention_mask=patch_mask)
