"""A causal mask's rows taken out of order: query rows gathered by index, so row i is not query i.

ProbSparse attention (Informer's `_prob_QK`: the top-u "active" queries, `Q[b, h, M_top]`, `topk(sorted=False)`) scores
only the queries it picked and masks each with its own causal row (`ProbMask`: `triu(1)[index]`): every row of a plane
keeps a prefix of the keys, each of another length (each query its own position), in the order the ranking gave. Rules
that read row i as query i (a token's own cell, a key hidden from its own query) would read the mask's own causality as
padding: they leave such a call alone. Read off the stored intervals, one run a row, without a pass over the cells.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import runs


def gathered_rows(call, stored: dict | None = None) -> bool:
    """Whether `call`'s mask (its stored one, or `stored`) is causal rows gathered: every row of each (batch row, head)
    plane keeps a prefix [0, n) of its own length n >= 1, and in some plane those lengths do not grow row by row (a
    causal mask in query order is left to the rules: it is no gather)."""
    q_len = call.shape[2]
    held = runs(call.stored if stored is None else stored, call.shape[3]) if q_len > 2 else None
    if held is None or held[0].shape[-1] != q_len:
        return False
    starts, ends = held
    if starts.any() or not ends.all():
        return False
    ordered = np.sort(ends, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        return False  # (two rows of one length: two queries at one position, or padding)
    return bool((np.diff(ends, axis=-1) < 0).any())
