"""A pass whose mask is causal in one batch row and lets another see every key, later ones too, at a site that decodes.

A causal decoder's prefill (a pass of as many queries as keys, decode steps behind a cache following it at the same
call site) masks each batch row alike where nothing the run states tells its rows apart: a row causal and a row
that sees every key of the same call, every query of both seeing a key (no padding row), is a causal mask that
reached only some rows. candle#3582: Qwen3's `causal_mask` filled one (L, L) triangle and labelled the buffer as
(B, 1, L, L), so batch row 0 was causal and the rows after it read memory never filled (zeros: no mask at all).
Rows told apart by what the model call states (token types, images: spans.py) are judged there, not here; a row
that sees later keys only in blocks (an image's span) is not a row that sees every key.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import cross, keep
from maskcli.text import Finding


def rows_lost(where: str, calls: list) -> list:
    """[(call, finding)] of the first pass of a site's `calls` causal in one batch row and full in another."""
    for n, call in enumerate(calls):
        if 2 <= call.shape[2] == call.shape[3]:
            cells = keep(call)
            if cells is not None and cells.ndim == 4 and cells.any(axis=-1).all():
                lost = causal_row_lost(where, call, cells, calls[n + 1:])
                if lost is not None:
                    return [(call, lost)]
    return []


def causal_row_lost(where: str, call, cells: np.ndarray, after: list) -> Finding | None:
    """The finding of `call` (a pass of a site, `cells` its keep cells (B, H, L, L), every query row seeing a key) whose
    batch rows are causal in one and full in another, decode steps (`after`: the site's later calls) following; None
    where its rows agree, or no step behind a cache follows."""
    q_len, k_len = call.shape[2:]
    if cells.ndim != 4 or cells.shape[0] < 2 or q_len != k_len or q_len < 2 or cross(call):
        return None
    if not any(later.shape[2] < later.shape[3] for later in after):
        return None
    triangle = np.tril(np.ones((q_len, k_len), dtype=bool))
    causal = [b for b in range(cells.shape[0]) if (cells[b] == triangle).all()]
    full = [b for b in range(cells.shape[0]) if cells[b].all()]
    if not causal or not full:
        return None
    return Finding("causal-lost", (
        f"batch row {full[0]} of step {call.step} at {where} sees every key, later ones too, while batch row "
        f"{causal[0]} of the same call is causal, and decode steps behind a cache follow at this site: the causal "
        f"mask reached only some batch rows (a mask built for one row and laid over the batch?)"),
        expected="causal in every batch row", source=f"batch row {causal[0]} of {where} at step {call.step}",
        cell=(full[0], 0, 1))
