"""The bias a FlexAttention score_mod adds, read as a function of the key's distance from the query (posbias.profile).

A score_mod that adds a value where it does not mask (flex.score_masking says so) is run once more on the whole index
grid with the score 0, where the call has at most posbias.MOST cells: what it returns on the cells the call keeps (its
block mask and its own -inf cells together) is the bias, profiled per head and distance as a softmax's added bias is
(details["position_bias"]: checks/relbias.py compares a site's steps, checks/alibisign.py reads its direction).
"""

from __future__ import annotations

import numpy as np
import torch

import maskcli.trace.posbias as posbias


def score_bias(score_mod, seen) -> dict | None:
    """The profile of what `score_mod` adds on the cells `seen` keeps; None where it is too large or cannot be read."""
    batch, heads, q_len, k_len = seen.shape
    planes = seen.planes
    if batch * heads * q_len * k_len > posbias.MOST or seen.intervals is None:
        return None
    try:
        from torch.nn.attention.flex_attention import _vmap_for_bhqkv

        run = _vmap_for_bhqkv(score_mod, prefix=(0,))
        b, h, m, n = (torch.arange(x) for x in (batch, heads, q_len, k_len))
        with torch.no_grad():
            bias = torch.broadcast_to(run(torch.zeros(batch, heads, q_len, k_len), b, h, m, n),
                                      (batch, heads, q_len, k_len)).to(torch.float64)
    except Exception:  # noqa: BLE001 - a score_mod that does not run so: nothing read
        return None
    stored = np.stack([seen.intervals.dense(plane, 0, q_len) for plane in range(planes[0] * planes[1])])
    keep = np.broadcast_to(stored.reshape(*planes, q_len, k_len), (batch, heads, q_len, k_len)) \
        & ~torch.isneginf(bias).numpy()  # (each (b, h) plane the intervals keep once, broadcast where they repeat)
    bias = bias.masked_fill(torch.from_numpy(~keep), 0.0)
    return posbias.profile((bias,), bias, torch.from_numpy(keep))
