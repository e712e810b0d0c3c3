"""What the function that attends was handed: a one-sided window it holds as its own argument or variable.

The innermost function of the program that calls the kernel (trace/sites.py window_handed) may hold its window in
the FlashAttention / FlashInfer convention: `window_left` = L, or `window_size` / `sliding_window` = (L, 0), so that
a query at position p sees keys p - L .. p. A real query that sees a key further back than L contradicts what the
function was handed: the window was dropped on some path (a decode shortcut that calls the kernel with no mask,
nanochat#452's `Tq == 1` branch, vllm-plugin-FL#489's `q_len == 1` one). Keys are placed where the cache puts them
(position j where the keys reach the query, else the most recent keys ending at it, as a cache sliced to the window
keeps them); a paged call whose columns are slots, and padding query rows, are left alone.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, columns_are_positions, first_cell, keep, queries
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _positions(call, own: np.ndarray, top) -> np.ndarray:
    """Each key column's absolute position: j where columns are positions, else the most recent keys ending at the
    last query."""
    k_len = call.shape[3]
    if columns_are_positions(call, top):
        return np.arange(k_len)
    last = int(own[-1])
    return np.arange(last + 1 - k_len, last + 1)


def window_dropped(run: Run) -> list:
    """A real query that sees a key older than the window its attending function holds."""
    found, done, kept = [], set(), set()
    for call in run.calls:
        handed = call.details.get("window_handed")
        if not handed or call.stored is None or call.details.get("slots") is not None:
            continue
        name, left = handed[0], int(handed[1])
        top = run.top(call)
        own = queries(call, top)
        key = (call.where, call.mask, call.shape, tuple(own), left)
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None:
            continue
        rows = by_row(cells, call.shape[0] if cells.shape[0] in (1, call.shape[0]) else None)
        real = resolve(call, top, rows)
        keys = _positions(call, own, top)
        older = (own[:, None] - keys[None, :]) > left  # (Lq, Lk): keys past the window's left edge
        bad = rows & older[None] & real.queries[:, :, None]
        if not bad.any():
            kept.add((call.step, call.shape[2:], tuple(handed)))
        else:
            b, q, k = first_cell(bad)
            found.append((call, Finding("window-dropped", (
                f"the function attending holds {name} = {_shown(name, left)} (a query at p sees keys p - {left} .. p), "
                f"but query {int(own[q])} of batch row {b} sees key {int(keys[k])}, {int(own[q] - keys[k])} back "
                f"({int(bad.sum())} such cells; step {call.step}): the window is dropped on this path"),
                expected=f"window({left + 1})", source=f"{name} held by the function that calls {call.api}",
                cell=(b, int(own[q]), int(keys[k])))))
    # a step at which another call handed the same window keeps to it: the window is chosen per layer (Gemma 2's
    # alternating local and global layers, one attend() for both), not dropped on a path (the layer rules judge that)
    return [(call, f) for call, f in found
            if (call.step, call.shape[2:], tuple(call.details["window_handed"])) not in kept]


def _shown(name: str, left: int) -> str:
    return str(left) if name == "window_left" else f"({left}, 0)"


RULES = (
    Rule("window-dropped", "wrong", "call", "a query that sees a key older than the one-sided window (window_left, "
         "window_size=(L, 0)) the function calling the kernel holds: a path that drops the window", window_dropped),
)
