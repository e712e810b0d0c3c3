"""torch.nn.functional.scaled_dot_product_attention: a bool attn_mask, True = may attend, or is_causal.

Documented rule (PyTorch SDPA docs): a boolean attn_mask "indicates whether the element
should take part in attention" (True = attend), broadcast to (B, H, Lq, Lk); a float mask is
added to the scores. is_causal=True is the top-left causal mask: query i sees keys j <= i
whatever Lk is ("the upper left causal bias ... when the mask is a non-square matrix", torch 2.13's
docstring), so it is this mask wherever query i faces key i; the bottom-right one (a decode step behind a cache)
is torch.nn.attention.bias.causal_lower_right.
A row that sees no key gives NaN or 0 by backend.
"""

from __future__ import annotations

import numpy as np

from maskcli.formats.base import Export, dense_cells

NAME = "sdpa"


def shape_of(mask) -> str:
    """'top-left', 'bottom-right', 'full' or '' from the intervals, without cells (O(L))."""
    if not mask.exact or mask.heads_differ:
        return ""
    f = mask.frame
    iv = mask.intervals()
    s, e = iv.starts, iv.ends
    if iv.per_row != 1:
        return ""
    if np.all(s == f.k_start) and np.all(e == f.k_end):
        return "full"
    diagonal = f.k_start + np.arange(f.q_len) + 1
    for name, shift in (("top-left", 0), ("bottom-right", f.k_len - f.q_len)):
        if np.all(s == f.k_start) and np.array_equal(np.broadcast_to(e, (mask.batch, f.q_len, 1))[..., 0],
                                                      np.broadcast_to(np.clip(diagonal + shift, f.k_start, f.k_end), (mask.batch, f.q_len))):
            return name
    return ""


def dense(mask) -> np.ndarray:
    """The keep cells, (Lq, Lk) where batch rows and heads are one, else (B, H', Lq, Lk)."""
    keep = dense_cells(mask, 1, "SDPA")
    return keep[0, 0] if keep.shape[:2] == (1, 1) else keep


def to(mask) -> Export:
    f = mask.frame
    shape = shape_of(mask)
    call = "out = F.scaled_dot_product_attention(q, k, v, {})  # q: (B, H, Lq, D), k and v: (B, H, Lk, D)"
    head = ["import torch", "import torch.nn.functional as F"]
    if shape == "full":
        return Export(head + [call.format("attn_mask=None")], {}, ["every query sees every key: no mask"], device="q.device")
    if shape == "top-left":
        why = "since Lq == Lk" if f.q_len == f.k_len else f"with {f.q_len} queries and {f.k_len} keys too (torch's CausalBias upper left)"
        return Export(head + [call.format("is_causal=True")], {}, [f"is_causal=True is top-left aligned: exactly this mask, {why}"], device="q.device")
    if shape == "bottom-right":
        return Export(head + ["from torch.nn.attention.bias import causal_lower_right",
                              call.format(f"attn_mask=causal_lower_right({f.q_len}, {f.k_len})")], {},
                      ["is_causal=True would be top-left (query 0 on key 0) and hide keys this mask shows; causal_lower_right aligns the last query with the last key"],
                      device="q.device")
    keep = dense(mask)
    notes = ["bool attn_mask: True = may attend (the opposite of nn.MultiheadAttention's)"]
    if not keep.any(-1).all():
        notes.append("some query rows see no key: SDPA gives NaN there on some backends")
    return Export(head + [call.format("attn_mask=<attn_mask>")], {"attn_mask": keep}, notes, device="q.device")
