"""A config kept as a dict at the top of the main module states `"bidirectional": True`; the encoder it builds
(`build_encoder(config)`, which keeps no config) masks with torch.tril; --fixed: no mask."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

config = {"d_model": 8, "n_heads": 2, "n_layers": 2, "bidirectional": True}


def build_encoder(config):
    return nn.ModuleList(nn.MultiheadAttention(config["d_model"], config["n_heads"], batch_first=True)
                         for _ in range(config["n_layers"]))


encoder = build_encoder(config)
x = torch.randn(1, 5, 8)
mask = None if FIXED else ~torch.tril(torch.ones(5, 5, dtype=torch.bool))
with torch.no_grad():
    for layer in encoder:
        x = x + layer(x, x, x, attn_mask=mask, need_weights=False)[0]
