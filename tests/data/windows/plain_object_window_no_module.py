"""Attention run by plain functions and objects, no nn.Module: the layer object states the window.

Bug: the backend calls SDPA with is_causal=True and never applies the layer's window. Fix: a windowed causal mask.
The window is an attribute of the plain object the backend is handed (as inference engines keep per-layer metadata).
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LayerMeta:
    def __init__(self, layer_id, sliding_window):
        self.layer_id = layer_id
        self.sliding_window = sliding_window


def backend(q, k, v, meta):
    if FIXED:
        p = torch.arange(q.shape[2])
        mask = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - meta.sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


torch.manual_seed(0)
meta = LayerMeta(0, 3)
q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
out = backend(q, k, v, meta)
print("done", tuple(out.shape))
