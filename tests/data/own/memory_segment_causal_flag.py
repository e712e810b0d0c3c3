"""Transformer-XL style, hand-written: a causal module (`self.causal = True`) attends a segment of 6 tokens over 4
cached memory states and the segment itself, scores (1, 2, 6, 10) through an eager softmax. Buggy: the causal mask is
built only when the caller passes `mask_future=True`, which this forward never does, so each query sees the later
tokens of its segment. `--fixed`: the module builds the mask from its own flag (a query at memory + i sees keys up to
memory + i)."""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class MemoryAttention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.causal = h, True
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)

    def forward(self, x, memory, mask_future=False):
        b, t, d = x.shape
        context = torch.cat([memory, x], dim=1)
        m = context.shape[1] - t
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, m + t, 2, self.h, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.h) ** 0.5
        if (FIXED and self.causal) or mask_future:
            later = torch.arange(m + t)[None, :] > (m + torch.arange(t))[:, None]
            scores = scores.masked_fill(later, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    attn = MemoryAttention().eval()
    with torch.no_grad():
        out = attn(torch.randn(1, 6, 16), torch.randn(1, 4, 16))
    print("fixed" if FIXED else "buggy", tuple(out.shape))


if __name__ == "__main__":
    main()
