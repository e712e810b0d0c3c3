"""An audio encoder with a CLS token in front and a local window, whose frame lengths never reach the mask.

Written for checks/rowless.py (padding-not-per-row), another way than docTR#1227: a bidirectional local window
(|q - k| <= 1) shared by every batch row as an additive float mask to SDPA, frames right-padded, `frame_lens`
counting the frames without the CLS token. Buggy: the padding part is built from `frame_lens` compared with itself
(always real); the fix compares the key positions with `frame_lens + 1`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LocalEncoder(nn.Module):
    def __init__(self, dim=16, heads=2, window=1):
        super().__init__()
        self.heads, self.window = heads, window
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, frames, frame_lens):
        b, _, d = frames.shape
        x = torch.cat([self.cls.expand(b, -1, -1), frames], 1)
        n = x.shape[1]
        at = torch.arange(n)
        band = (at[None, :] - at[:, None]).abs() <= self.window
        if FIXED:
            real = at[None, :] < (frame_lens + 1)[:, None]
        else:
            real = (frame_lens[:, None] >= frame_lens[:, None]).expand(b, n)
        keep = band[None, None] & real[:, None, None, :]
        bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


if __name__ == "__main__":
    model = LocalEncoder().eval()
    frames = torch.randn(2, 5, 16)
    frame_lens = torch.tensor([3, 5])
    frames[0, 3:] = 0.0
    with torch.no_grad():
        batched = model(frames, frame_lens)
        alone = model(frames[:1, :3], frame_lens[:1])
    print("fixed" if FIXED else "buggy", "short row batched vs alone:", f"{(batched[0, :, :4] - alone[0]).abs().max().item():.4f}")
