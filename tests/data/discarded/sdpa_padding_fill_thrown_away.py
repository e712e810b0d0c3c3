"""An additive causal bias handed to SDPA whose key padding fill was thrown away (Qwen#933's kind, written otherwise).

The bias is made causal (assigned), then `torch.masked_fill(bias, pad, -inf)` as a statement: the function form,
a key padding fill of a left-padded batch (row 1 leads with 2 pads), the bias passed as the `attn_mask` keyword.
The real queries of row 1 attend its padding. Fixed: the fill's result assigned.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
lengths = torch.tensor([5, 3])
pad = torch.arange(5)[None, :] < (5 - lengths)[:, None]  # left padding: True on a row's leading pads
bias = torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
bias = bias.expand(2, 1, 5, 5)
if FIXED:
    bias = torch.masked_fill(bias, pad[:, None, None, :], float("-inf"))
else:
    torch.masked_fill(bias, pad[:, None, None, :], float("-inf"))
out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
print("out", tuple(out.shape), "row 1 query 4:", round(float(out[1, 0, 4].sum()), 4))
