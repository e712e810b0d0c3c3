"""Two layers kept under names, not numbers (self.local, self.wide): each knows its own layer_idx.

Bug: the local layer (layer_types[0] = sliding_attention) is run plain causal. Fix: it gets the window. The config
is a dict the model keeps; the layers' module paths carry no number, their layer_idx says which is which.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
CONFIG = {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]}


class Block(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, window):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        p = torch.arange(x.shape[1])
        mask = p[None, :] <= p[:, None]
        if window is not None:
            mask &= p[None, :] > p[:, None] - window
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(1, -1, 8)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = CONFIG
        self.wide = Block(1)
        self.local = Block(0)

    def forward(self, x):
        x = x + self.local(x, self.cfg["sliding_window"] if FIXED else None)
        return x + self.wide(x, None)


torch.manual_seed(0)
with torch.no_grad():
    out = Model()(torch.randn(1, 7, 8))
print("done", tuple(out.shape))
