"""A conformer-style encoder whose frame lengths are rounded up (`ceil(n / 4)`) where its two valid (unpadded)
stride-2 convolutions of kernel 5 make fewer frames: a short row's last frames, computed from padding, are keys.

Written for maskcli's tests (checks/subsampled.py), unlike fairseq#3227 and wenet#1602: Conv1d over (B, C, T)
features with no padding, lengths handed as `feature_lens`, the frame mask built from the rounded lengths and handed
to SDPA as a boolean keep mask; the batch is right-padded with three rows.
Fix (--fixed): the convolutions' own output length, (n - 5) // 2 + 1 twice.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Subsampling(nn.Module):
    def __init__(self, feats, dim):
        super().__init__()
        self.conv1 = nn.Conv1d(feats, dim, kernel_size=5, stride=2)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=5, stride=2)

    def forward(self, x):
        return self.conv2(F.silu(self.conv1(x.transpose(1, 2)))).transpose(1, 2)

    def lengths(self, n):
        if FIXED:
            for _ in range(2):
                n = (n - 5) // 2 + 1
            return n
        return torch.ceil(n / 4).long()


class Encoder(nn.Module):
    def __init__(self, feats=8, dim=16, heads=2):
        super().__init__()
        self.sub = Subsampling(feats, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, features, feature_lens):
        x = self.sub(features)
        b, t, d = x.shape
        real = torch.arange(t)[None, :] < self.sub.lengths(feature_lens)[:, None]
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
        return out.transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    feature_lens = torch.tensor([41, 30, 23])
    features = torch.randn(3, 41, 8) * (torch.arange(41)[None, :, None] < feature_lens[:, None, None])
    with torch.no_grad():
        out = Encoder().eval()(features, feature_lens)
    print("fixed" if FIXED else "buggy", tuple(out.shape))


if __name__ == "__main__":
    main()
