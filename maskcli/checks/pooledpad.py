"""Attention pooling that weighs positions the model call states are padding (a pooling softmax over the pads).

A classification head that pools a padded batch with learned weights, `softmax(weighting_layer(h), dim=1)` then
`sum(weights * h, dim=1)` (or `bmm(weights.unsqueeze(1), h)`, an einsum), normalises the weights over every position:
the pads take weight and the pooled vector of a padded row differs from the same sequence run alone (nbrg-ppcu/prokbert
PR #109: the fix fills the scores at `attention_mask == 0` with -inf before the softmax). trace/poolweights.py records
each pooling as a call (batch, 1, 1, positions) keeping the positions it weighs; the model call's own statement of its
padding (real.py's `stated`: its attention_mask, a key padding mask, lengths, the input ids at the pad id) over as many
rows and positions says which are pads. Wrong where a row with real tokens gives a pad weight; quiet where the pads'
weights are 0 (filled before the softmax, or no pads), and where nothing the model call holds states its padding.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def pooled_padding(run: Run) -> list:
    """Poolings (details' `pooled_weights`) whose weights reach a position the model call states is padding."""
    found = []
    for call in [*run.calls, *run.cross, *run.unmasked]:
        pooled = call.details.get("pooled_weights")
        if not isinstance(pooled, dict):
            continue
        rows, length = call.shape[0], call.shape[3]
        said = stated(run.top(call), rows, length)
        cells = keep(call)
        if said is None or cells is None:
            continue
        real, source, sure = said
        weighed = np.broadcast_to(cells[:, 0, 0, :], (rows, length))
        bad = weighed & ~real & real.any(axis=1, keepdims=True)
        if not bad.any():
            continue
        b, k = first_cell(bad)
        found.append((call, Finding("pooled-over-padding", (
            f"batch row {b}: the pooling weights, softmaxed over axis {pooled['axis']} of their {tuple(pooled['shape'])} "
            f"and applied by {pooled['how']}, give position {k} a weight, which the {source} marks as padding "
            f"({int(bad.sum())} such positions): the softmax runs over the pads (fill their scores with -inf before it)"
            + ("" if sure else f" (if token id {run.top(call).arguments.get('pad_id')} is padding there)")),
            None if sure else "suspicious", expected="no weight on a padding position", source=source,
            cell=(b, 0, k))))
    return found


RULES = (
    Rule("pooled-over-padding", "wrong", "call", "attention pooling (a softmax's weights over the positions, weighing "
         "the values along them) that gives weight to positions the model call states are padding", pooled_padding),
)
