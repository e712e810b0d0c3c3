"""XLNet's query stream: a predict that stands for no position in one batch row while it does in another.

- query-unplaced: the model call's `target_mapping` (B, P, L) (trace/targetmap.py) says which position each of a row's
  P query-stream queries predicts; the rows of one batch that place their predicts (one position each) disagree: a
  row's predict i maps to no position while another row's predict i maps to one. The kernel's query for it is the
  mapping times the query stream, taken from no position: it predicts from nowhere
  (huggingface/transformers#7267: prepare_inputs_for_generation set `target_mapping[0, 0, -1] = 1.0`, batch row 0
  only, so every other row of a batched or beam decode predicted from nothing). Left alone: a predict the loss ignores
  (`labels` -100 at it: XLNet's pretraining pads its predictions with all-zero rows), and a mapping whose rows place
  nothing anywhere or more than one position (not a placement).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def unplaced(run: Run) -> list:
    """A batch row's query-stream predict that target_mapping maps to no position where another row's maps to one."""
    found = []
    for top in run.tops:
        mapping = top.arguments.get("target_mapping")
        if mapping is None:
            continue
        placed = mapping.sum(axis=-1)  # (B, P): positions each predict stands for
        if placed.max() != 1:
            continue
        empty = (placed == 0) & (placed == 1).any(axis=0, keepdims=True)
        labels = top.arguments.get("target_labels")
        if labels is not None:
            empty &= labels != -100
        call = next((c for c in run.calls if run.top(c) is top and c.shape[0] == mapping.shape[0]), None)
        if not empty.any() or call is None:
            continue
        b, i = (int(x) for x in np.argwhere(empty)[0])
        other = int(np.flatnonzero(placed[:, i] == 1)[0])
        position = int(np.flatnonzero(mapping[other, i])[0])
        found.append((call, Finding("query-unplaced", (
            f"batch row {b}: its query-stream predict {i} stands for no position (target_mapping of {top.where} is all "
            f"0 there), while batch row {other}'s predict {i} stands for position {position}: its query is taken from "
            f"no position (the mapping times the query stream is zero), so it predicts from nowhere ({int(empty.sum())} such predicts): "
            f"the mapping set for some rows only?"), expected=f"predict {i} of every row placed",
            source="target_mapping", cell=(b, i, position))))
    return found


RULES = (
    Rule("query-unplaced", "wrong", "steps", "a query-stream predict that target_mapping places in one batch row and "
         "not in another (the rows' queries from nowhere)", unplaced),
)
