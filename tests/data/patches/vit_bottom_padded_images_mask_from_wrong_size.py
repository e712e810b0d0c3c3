"""A ViT over images padded at the bottom to one height, whose patch mask is built from the padded size instead of
each image's own: the shorter image's last patch row (exactly 0 pixels) is attended by its real patches.

Written for maskcli's tests (checks/padded-patches-attended), unlike MiniCPM-V#274: a Conv2d patch embedding over a
2-D grid (4 x 4 patches of 4 pixels, row by row), images padded with F.pad at the bottom, the mask handed to
nn.MultiheadAttention as `key_padding_mask=~patch_attention_mask`.
Fix (--fixed): each image's own number of patch rows marks the mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
PATCH = 4


class TinyViT(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, PATCH, stride=PATCH)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, pixel_values, patch_attention_mask):
        x = self.embed(pixel_values).flatten(2).transpose(1, 2)  # (B, patches, dim), row by row
        out, _ = self.attn(x, x, x, key_padding_mask=~patch_attention_mask, need_weights=False)
        return out


def main():
    torch.manual_seed(0)
    images = [torch.randn(3, 16, 16), torch.randn(3, 12, 16)]  # 4 and 3 patch rows of 4 patches
    pixel_values = torch.stack([F.pad(im, (0, 0, 0, 16 - im.shape[1])) for im in images])
    rows = [im.shape[1] // PATCH if FIXED else pixel_values.shape[2] // PATCH for im in images]
    patch_attention_mask = torch.stack([torch.arange(16) < r * 4 for r in rows])
    with torch.no_grad():
        out = TinyViT().eval()(pixel_values, patch_attention_mask)
    print("fixed" if FIXED else "buggy", f"{out.sum().item():.4f}")


if __name__ == "__main__":
    main()
