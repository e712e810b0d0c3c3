"""The model of namedtuple_in_model_module.py: its ModelArgs, a NamedTuple kept at the top of this module (ARGS), as
a reference implementation's model.py keeps its defaults; the window mask built with triu(-W), one key too wide
(W + 1 keys with the query); --fixed: triu(1 - W)."""

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F



class ModelArgs(NamedTuple):
    n_layers: int = 2
    n_heads: int = 1
    sliding_window: int = 3


ARGS = ModelArgs()


class Model(torch.nn.Module):
    def forward(self, x):
        n = x.shape[-2]
        fixed = "--fixed" in sys.argv  # (read at each call: a test process imports this module once)
        keep = torch.ones(n, n, dtype=torch.bool).tril().triu(1 - ARGS.sliding_window if fixed else -ARGS.sliding_window)
        for _ in range(ARGS.n_layers):
            x = x + F.scaled_dot_product_attention(x, x, x, attn_mask=keep)
        return x
