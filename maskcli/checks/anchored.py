"""A sliding layer whose window is laid on the call's own rows, not on its queries' positions (checks/config.py's
layers and placing).

A band `triu(-W + 1) * tril(W - 1)` built on the (query, key) mask of a call whose queries sit past the cache's start
(a decode step, a later prefill chunk) is the band of rows 0, 1, ...: a decode query at position p keeps keys 0 .. W - 1
(with the causal part, k <= p), whatever p is (keras-team/keras-hub#1738). Said only where the queries' positions are
known (the model call's cache_position / input_pos / start_pos / cache_update_index, or a cache that keeps every key),
the config states the window, the cells are exactly that row band on every real query and key, and not the window.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import _each_layer_call, _layer
from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _on_rows(placed, size: int, band: bool) -> np.ndarray:
    """Keys k <= q (the causal part, by position) with k > i - size, i the call's own row (and k < i + size where
    `band`: a triu * tril band): the window's bound laid on the rows."""
    q, k = placed.own[:, None], placed.keys[None, :]
    rows = np.arange(placed.own.shape[0])[:, None]
    return ((k <= q) & (k > rows - size) & ((k < rows + size) if band else True))[None, None]


def anchored(run: Run) -> list:
    """A sliding layer whose window is that of the call's rows 0, 1, ... rather than of its queries' positions."""
    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None or stated.bidirectional():
            continue
        size, name = stated.window()
        sizes = (size, size - 1) if name == "sliding_window_size" and size > 1 else (size,)  # (with the query or not)
        if int(placed.own[0]) < 1 or placed.holds("causal") or any(placed.holds(f"window({w})") for w in sizes):
            continue  # (queries from position 0: the rows are the positions, and the band is the window)
        for size, band in ((w, band) for w in sizes for band in (True, False)):
            expected = np.broadcast_to(_on_rows(placed, size, band), placed.judged.shape)
            if not ((placed.seen != expected) & placed.judged).any():
                break
        else:
            continue
        first, source = int(placed.own[0]), stated.said(name)
        seen = np.flatnonzero(placed.seen[0, 0, 0] & placed.real_k[0])
        found.append((call, Finding("window-anchored-at-row", (
            f"{_layer(index, call)} keeps the window of its rows, not of its queries' positions: the query at "
            f"position {first} sees keys {_span(seen)} (row 0's window of {size}), not {max(0, first - size + 1)}-"
            f"{first} ({source}): the window was laid on the call's (query, key) mask without the cache offset"),
            expected=f"window({size})", source=source)))
    return found


def _span(keys: np.ndarray) -> str:
    if keys.size == 0:
        return "none"
    return f"{keys[0]}-{keys[-1]}" if keys.size == keys[-1] - keys[0] + 1 else ", ".join(str(k) for k in keys)


RULES = (
    Rule("window-anchored-at-row", "wrong", "steps", "a sliding layer whose window is laid on the call's rows 0, 1, ... "
         "(a decode step keeps keys 0 .. W - 1) instead of its queries' positions (keras-hub#1738)", anchored),
)
