# A correct program of the shape heads-as-positions reads: a speech enhancer whose band attention cuts each frame's
# projection into 6 sub-band tokens, `.view(B, T, bands, D)`, and hands that to SDPA on purpose (frames as SDPA's
# batch-like second axis, attention over a frame's own bands). The band module states its band count, not a head
# count; the enclosing block's temporal attention states 6 heads (as many as bands) and transposes its (B, T, H, D)
# properly. A second band attention states 2 heads of its own, over 6 bands. Nothing says a head count was meant
# where the kernel's positions are: quiet, with or without --fixed (which changes nothing).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class BandAttention(nn.Module):
    def __init__(self, dim, num_bands, band_dim):
        super().__init__()
        self.num_bands, self.band_dim = num_bands, band_dim
        self.qkv = nn.Linear(dim, 3 * num_bands * band_dim)
        self.out = nn.Linear(num_bands * band_dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.num_bands, self.band_dim) for z in (q, k, v))  # bands of one frame
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.reshape(b, t, -1))


class GroupedBandAttention(BandAttention):
    def __init__(self, dim, num_bands, band_dim, num_heads=2):
        super().__init__(dim, num_bands, band_dim)
        self.num_heads = num_heads  # (a head count of its own, not its band count)


class TemporalAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, pad):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=pad[:, None, None, :])
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class EnhancerBlock(nn.Module):
    def __init__(self, dim=48, num_heads=6, num_bands=6):
        super().__init__()
        self.num_heads = num_heads
        self.band = BandAttention(dim, num_bands, 8)
        self.grouped = GroupedBandAttention(dim, num_bands, 8)
        self.time = TemporalAttention(dim, num_heads)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, pad):
        x = x + self.band(self.norm(x))
        x = x + self.grouped(self.norm(x))
        return x + self.time(self.norm(x), pad)


def main():
    torch.manual_seed(0)
    block = EnhancerBlock()
    lengths = torch.tensor([20, 14])
    pad = torch.arange(20)[None, :] < lengths[:, None]  # True = a real frame
    x = torch.randn(2, 20, 48)
    y = block(x, pad)
    loss = (y * pad[..., None]).pow(2).mean()
    loss.backward()
    print(f"fixed={FIXED} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
