"""A Gemma-style pattern in a SimpleNamespace at main()'s level: sliding_window_pattern=2 (every second layer full, as
transformers reads it: full where (i + 1) % 2 == 0); the program windows the odd layers; --fixed: the even ones."""

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(torch.nn.Module):
    def __init__(self, idx, window):
        super().__init__()
        self.window = window if ((idx % 2 == 0) if FIXED else (idx % 2 == 1)) else None

    def forward(self, x):
        n = x.shape[-2]
        bias = torch.zeros(n, n)
        for q in range(n):
            for k in range(n):
                if k > q or (self.window is not None and q - k >= self.window):
                    bias[q, k] = float("-inf")
        return x + F.scaled_dot_product_attention(x, x, x, attn_mask=bias)


def main():
    args = SimpleNamespace(n_layer=4, sliding_window=3, sliding_window_pattern=2)
    model = torch.nn.Sequential(*[Block(i, args.sliding_window) for i in range(args.n_layer)])
    with torch.no_grad():
        model(torch.randn(1, 1, 7, 4))


main()
