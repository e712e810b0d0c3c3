# The jasmine 3ec820d bug written another way: a Perceiver-style latent cross-attention whose kernel wants the key
# length a multiple of 8. The projected K and V (head-major, (B, H, L, D)) are padded with torch.cat of zeros, and
# the additive float mask that should hide the added keys is filled from the PADDED length (`mask[..., padded:]`,
# an empty slice), so every latent attends the zero keys; the fix fills it from the real length.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, BLOCK = 32, 4, 8


def block_padded_attention(q, k, v):
    """SDPA over keys padded up to a multiple of BLOCK; the added keys hidden by an additive mask."""
    length = k.shape[2]
    padded = -(-length // BLOCK) * BLOCK
    extra = k.new_zeros(*k.shape[:2], padded - length, k.shape[3])
    k, v = torch.cat([k, extra], dim=2), torch.cat([v, extra], dim=2)
    mask = torch.zeros(q.shape[0], 1, q.shape[2], padded)
    mask[..., (length if FIXED else padded):] = float("-inf")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LatentCrossAttention(nn.Module):
    def __init__(self, latents=6):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, D))
        self.q, self.kv, self.out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, inputs, attend=block_padded_attention):
        b, n, _ = inputs.shape
        q = self.q(self.latents).expand(b, -1, -1).reshape(b, -1, HEADS, D // HEADS).permute(0, 2, 1, 3)
        k, v = self.kv(inputs).reshape(b, n, 2, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        o = attend(q, k, v).permute(0, 2, 1, 3).reshape(b, -1, D)
        return self.out(o)


block = LatentCrossAttention().eval()
frames = torch.randn(3, 13, D)  # 13 input tokens: padded to 16
with torch.no_grad():
    got = block(frames)
    ref = block(frames, attend=F.scaled_dot_product_attention)
print(f"max |padded kernel - plain SDPA|: {(got - ref).abs().max().item():.6f}")
