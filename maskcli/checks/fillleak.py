"""A float attn_mask whose fill is shallower than the scores are apart: the cells it masks keep softmax weight.

trace/fillleak.py records at an SDPA call handed a float mask with a finite fill (at most -1e4, not -inf) whether
the kernel's softmax over q @ kᵀ · scale plus that mask still gives the cells the mask lowers weight: some query row
with at least 1% of its weight on them (details["fill_leak"]), judged on the real queries (checks/real.py). The program states there which keys each query must
not read (the cells it lowers); the scores outgrow the fill, so the kernel attends them anyway: wrong
(NVIDIA/TensorRT-Model-Connect#695: GPT-NeoX's kMaskedScore = -1e4 beside Pythia-scale logits, future prompt tokens
and empty cache slots leaked; the fix fills -1e9). Quiet on -inf and finfo.min fills, and wherever the scores lie
within the fill of each other (BERT's -10000.0 beside ordinary logits: every call that stops at trace's bound).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def fill_leaks(run: Run) -> list:
    """Calls whose float mask's finite fill leaves the masked cells softmax weight in a real query's row, once per call
    site and shape (a padding query's row is no token's: left alone)."""
    found, done = [], set()
    for call in run.calls:
        leak = call.details.get("fill_leak")
        if not leak or (call.where, call.shape) in done:
            continue
        rows = leak["rows"]
        cells = keep(call)
        if cells is not None and cells.shape[0] in (1, rows.shape[0]):
            real = resolve(call, run.top(call), by_row(cells, rows.shape[0])).queries
            rows = rows & np.broadcast_to(real, rows.shape) if real.shape[1] == rows.shape[1] else rows
        if not rows.any():
            continue
        done.add((call.where, call.shape))
        b, q = (int(i) for i in np.argwhere(rows)[0])
        k = int(leak["key"][b, q])
        found.append((call, Finding("fill-leaks", (
            f"{call.where}'s float attn_mask masks cells with {leak['value']:g}, but its scores (q·kᵀ·scale) outgrow "
            f"the fill: softmax still gives the masked cells weight ({int(rows.sum()):,} real query rows put 1% or "
            f"more of their weight on them; batch row {b}, query {q}: {float(leak['weight'][b, q]):.0%}, most on masked "
            f"key {k}, whose score is {float(leak['above'][b, q]):.4g} above the best key the row keeps); fill with "
            "-inf or torch.finfo(dtype).min"),
            expected="masked cells weigh 0", source=f"a fill of {leak['value']:g} in the attn_mask", cell=(b, q, k))))
    return found


RULES = (
    Rule("fill-leaks", "wrong", "call", "a float attn_mask whose finite fill (-1e4) is shallower than the scores are "
         "apart: the kernel's softmax still weighs the cells it masks", fill_leaks),
)
