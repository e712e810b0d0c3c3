"""A packed batch through a model whose sliding layers build their own window mask: the layer is handed the
documents' bool mask (B, 1, L, L), True = may attend, and replaces it with the window, so a document's first tokens
see the end of the one packed before it. --fixed ands the window onto the mask it was handed.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class SlidingLayer(nn.Module):
    def __init__(self, width=16, heads=2, window=3):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, attention_mask):
        b, t, d = x.shape
        i = torch.arange(t)
        window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        mask = attention_mask & window if FIXED else window.expand(b, 1, t, t)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main():
    torch.manual_seed(0)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]])
    i = torch.arange(7)
    attention_mask = ((doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None]))[:, None]
    with torch.no_grad():
        out = SlidingLayer().eval()(torch.randn(2, 7, 16), attention_mask)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
