"""Keys of an nn.MultiheadAttention call whose K and V are exactly zero: zero input rows under zero projection biases.

trace/zerokv.py reads an SDPA call's own K and V for edge runs of zero keys (the data's padding). F.multi_head_attention
_forward projects its key and value inputs itself, so the projected K and V are never handed to a kernel that is
traced. A key input row that is zero in every dimension, projected by `in_proj_bias` (or `bias`) whose key and value
parts are zero (nn.MultiheadAttention initialises them so, and nothing after a fresh model changes them), gives a key
and a value exactly zero in every head: the same padding zerokv reads (poprox-recommender#177: NRMS's click history
left-padded with "PADDED_NEWS" zero vectors, its MHA handed no key_padding_mask). So the inputs are read as K and V
where both biases are zero and there is no bias_k, add_zero_attn or static K/V; recorded as zerokv's `zero_kv` table
(checks/zerokv.py says where real queries see them). Cheap: zero_kv reads each row's edge keys first.

Read only where the call is handed no mask at all: biases zero is how nn.MultiheadAttention starts, not what a trained
one holds, so zero K and V are the data's statement only where the program states nothing else; a call handed a mask
(SASRec.pytorch's causal attn_mask over left-padded histories whose pads it zeroes by its own timeline mask) is left
to the rules that read that mask.
"""

from __future__ import annotations

import torch

from maskcli.trace.zerokv import zero_kv


def mha_zero_kv(a: dict) -> dict:
    """zero_kv's details for F.multi_head_attention_forward's bound arguments `a` (inputs (L, N, E) or (L, E), no
    attn_mask or key_padding_mask), or {}."""
    q, k, v = a["query"], a["key"], a["value"]
    if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None or a["static_v"] is not None:
        return {}
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() not in (2, 3):
        return {}
    with torch.no_grad():
        if not _zero_biases(a["in_proj_bias"], q.shape[-1]):
            return {}
        q4, k4, v4 = (t.unsqueeze(1) if t.dim() == 2 else t for t in (q, k, v))
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(1) for t in (q4, k4, v4))  # (N, 1, L, E)
    return zero_kv(q4, k4, v4, tuple(k4.shape))


def _zero_biases(bias, embed: int) -> bool:
    """The key and value projections' biases (in_proj_bias's second and third thirds, with separate weights too) are
    zero, or there is none."""
    return bias is None or (bias.numel() == 3 * embed and not bool(bias[embed:].any()))
