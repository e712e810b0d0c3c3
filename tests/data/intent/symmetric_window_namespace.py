"""A local-attention encoder configured by argparse (an argparse Namespace at the top of the main module: n_heads,
causal=False, window_size=2); its layers build the band with torch.tril / triu, but only the lower band; --fixed: both bands."""

import argparse
import sys

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--n-heads", type=int, default=2)
parser.add_argument("--window-size", type=int, default=2)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--fixed", action="store_true")
args = parser.parse_args()


class LocalLayer(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, x):
        n = x.shape[-2]
        ones = torch.ones(n, n, dtype=torch.bool)
        lower = torch.tril(ones) & torch.triu(ones, -(self.window - 1))
        keep = lower | lower.T if args.fixed else lower
        return x + F.scaled_dot_product_attention(x, x, x, attn_mask=keep)


layers = torch.nn.Sequential(LocalLayer(args.window_size), LocalLayer(args.window_size))
with torch.no_grad():
    layers(torch.randn(1, 2, 7, 4))
