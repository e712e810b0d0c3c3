"""Per-frame patch attention of a batch of videos, scores (B, T, H, N, N) from one einsum: a frame axis before the heads.

Each video has 2 frames; each frame keeps only its first n valid patches (a variable-resolution crop, patch padding),
so every (video, frame) plane has its own key padding: the frame axis is batch-like, only the axis before the queries
is heads. The padding (B, T, N) is laid on the scores as pad[:, :, None, None, :]. With --buggy the program keeps only
each video's first frame's padding, (B, N), and writes pad[:, None, None, :]: against 5-D scores it lands on the frame
axis, so video b's padding is laid on frame b of every video (as a (B, 1, L, S) mask against grouped-query scores,
ml-explore/mlx-lm#1903). B == T == 2, so the buggy program runs and is silently wrong.
"""
import sys

import torch
from torch import nn

BUGGY = "--buggy" in sys.argv


class FrameAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x, valid):  # x (B, T, N, C), valid (B, T, N) bool
        b, t, n, c = x.shape
        q, k, v = self.qkv(x).view(b, t, n, 3, self.heads, c // self.heads).unbind(3)
        scores = torch.einsum("btqhd,btkhd->bthqk", q, k) / (c // self.heads) ** 0.5
        pad = valid[:, 0][:, None, None, :] if BUGGY else valid[:, :, None, None, :]
        scores = scores.masked_fill(~pad, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        y = torch.einsum("bthqk,btkhd->btqhd", weights, v).reshape(b, t, n, c)
        return self.out(y)


def main():
    torch.manual_seed(0)
    counts = torch.tensor([[6, 4], [3, 5]])  # valid patches per (video, frame), of 6
    valid = torch.arange(6)[None, None, :] < counts[:, :, None]
    model = FrameAttention().eval()
    with torch.no_grad():
        y = model(torch.randn(2, 2, 6, 16), valid)
    print("frames", tuple(y.shape), f"{y[valid].abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
