# Written another way (the kind of samvanstroud/hepattn#148): a Perceiver-style encoder over a padded batch of point
# clouds. Its latents cross-attend to the points through an eager softmax (matmul, masked_fill, softmax); the encoder
# builds a (B, latents, points) bool mask, True = masked (the padded points, and each latent's sector of the cloud),
# and hands it positionally to each block. The blocks were built with `masked=False` (a flag another code path
# needed), so their forward rebinds the mask to None and every latent attends to every point, padding included.
# Fixed: the blocks use the mask they are handed.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, latents, points, pad_mask=None):
        b, n, d = latents.shape
        q = self.to_q(latents).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(points).view(b, points.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if pad_mask is not None:
            scores = scores.masked_fill(pad_mask[:, None], -math.inf)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class LatentBlock(nn.Module):
    def __init__(self, dim, masked):
        super().__init__()
        self.masked = masked
        self.norm = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, latents, points, cross_attn_mask=None):
        if not self.masked and not FIXED:
            cross_attn_mask = None
        latents = latents + self.cross(self.norm(latents), points, pad_mask=cross_attn_mask)
        return latents + self.ff(latents)


def sector_mask(lengths, n_latents, n_points):
    """True = masked: the padded points, and the points outside each latent's sector (a third of the cloud either
    side of its own share)."""
    keep = torch.zeros(len(lengths), n_latents, n_points, dtype=torch.bool)
    for b, length in enumerate(lengths):
        share = length / n_latents
        for i in range(n_latents):
            lo, hi = max(0, int(i * share - share)), min(length, int((i + 2) * share) + 1)
            keep[b, i, lo:hi] = True
    return ~keep


dim, n_latents = 16, 4
blocks = nn.ModuleList([LatentBlock(dim, masked=False) for _ in range(2)]).eval()
latents0 = nn.Parameter(torch.randn(n_latents, dim))
lengths = [20, 13]
points = torch.randn(2, 20, dim)
points[1, 13:] = 0.0  # the second cloud right-padded to 20
mask = sector_mask(lengths, n_latents, 20)
with torch.no_grad():
    latents = latents0.expand(2, -1, -1)
    for block in blocks:
        latents = block(latents, points, mask)
    moved = points.clone()
    moved[1, 13:] = 9.0  # only the padding moves
    again = latents0.expand(2, -1, -1)
    for block in blocks:
        again = block(again, moved, mask)
print(f"fixed={FIXED} latent change when only padded points move: {(again - latents).abs().max().item():.3e}")
