"""A window kept in a plain dict at the top of the main module and handed to a mask builder; the model keeps only
the mask. The builder counts the window's keys before the query (one wider); --fixed: the query counted too."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

hf_config = {"hidden_size": 8, "num_hidden_layers": 2, "sliding_window": 4}


def build_mask(config, length):
    mask = torch.full((length, length), float("-inf"))
    for q in range(length):
        lo = q - config["sliding_window"] + (1 if FIXED else 0)
        mask[q, max(lo, 0):q + 1] = 0.0
    return mask


class Layer(torch.nn.Module):
    def forward(self, x, bias):
        return x + F.scaled_dot_product_attention(x, x, x, attn_mask=bias)


class Model(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x):
        bias = build_mask(hf_config, x.shape[-2])
        for block in self.blocks:
            x = block(x, bias)
        return x


with torch.no_grad():
    Model(hf_config["num_hidden_layers"])(torch.randn(1, 2, 9, 4))
