"""A BERT-style decoder block whose cross-attention module says so (`is_cross_attention=True`) but shares the
self-attention's `is_causal=True` when it calls SDPA: caption token i sees only image features 0..i. --fixed calls
the cross-attention with no causal mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, width, heads, is_cross_attention=False):
        super().__init__()
        self.heads, self.is_cross_attention = heads, is_cross_attention
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)

    def forward(self, hidden, context=None, is_causal=False):
        source = hidden if context is None else context
        b, t, d = hidden.shape
        q = self.q(hidden).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal).transpose(1, 2).reshape(b, t, d)


class Block(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.attention = Attention(width, heads)
        self.crossattention = Attention(width, heads, is_cross_attention=True)

    def forward(self, hidden, image_features):
        hidden = hidden + self.attention(hidden, is_causal=True)
        causal = not FIXED  # the bug: the self-attention's flag handed to the cross-attention too
        return hidden + self.crossattention(hidden, context=image_features, is_causal=causal)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = Block().eval()(torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
