# Written for maskcli's tests (the bug of microsoft/onnxruntime#25360 written another way): a NaViT-style vision
# tower (Idefics2's / MiniCPM-V's shape: images of different sizes as patch sequences padded to one length, a
# (B, 1, P) `patch_attn_mask`, True = a real patch) whose attention is written by hand. An export helper lowers every
# attention that carries a mask to a "masked causal" kernel, so each image's patches attend only the patches before
# them in raster order. Fixed: causal only where the model is a decoder (the tower is not).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
WIDTH, HEADS, PATCH = 16, 2, 4


def lowered_attention(q, k, v, key_keep, causal):
    scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
    hide = ~key_keep[:, None, None, :]
    if causal:
        n = scores.shape[-1]
        hide = hide | torch.ones(n, n, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(hide, float("-inf"))
    return scores.softmax(-1) @ v


class TowerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, key_keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        out = lowered_attention(q, k, v, key_keep, causal=not FIXED)  # (the export helper's flag: "has a mask")
        return x + self.proj(out.transpose(1, 2).reshape(b, n, WIDTH))


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(3 * PATCH * PATCH, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, 16, WIDTH) * 0.02)
        self.blocks = nn.ModuleList([TowerBlock() for _ in range(2)])

    def forward(self, pixel_values, patch_attn_mask):
        b, n, _ = pixel_values.shape
        x = self.patch_embed(pixel_values) + self.pos[:, :n]
        key_keep = patch_attn_mask[:, 0, :]
        for block in self.blocks:
            x = block(x, key_keep)
        return x


def patchify(image):
    c, h, w = image.shape
    return image.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).permute(1, 2, 0, 3, 4).reshape(-1, c * PATCH * PATCH)


images = [torch.rand(3, 12, 12), torch.rand(3, 8, 12)]  # 9 patches and 6 patches
slices = [patchify(im) for im in images]
longest = max(s.shape[0] for s in slices)
pixel_values = torch.zeros(2, longest, 3 * PATCH * PATCH)
patch_attn_mask = torch.zeros(2, 1, longest, dtype=torch.bool)
for i, s in enumerate(slices):
    pixel_values[i, :s.shape[0]] = s
    patch_attn_mask[i, 0, :s.shape[0]] = True
tower = VisionTower().eval()
with torch.no_grad():
    out = tower(pixel_values, patch_attn_mask)
    flipped = tower(torch.flip(pixel_values[:1], dims=[1]), patch_attn_mask[:1])  # the same patches in reverse order
print(f"fixed={FIXED} |mean over patches, order reversed - as given| = "
      f"{(out[0].mean(0) - flipped[0].mean(0)).abs().max().item():.3e}")
