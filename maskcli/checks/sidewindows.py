"""A layer's look-ahead window one key short of the (left, right) window its config states for it.

A streaming encoder states each layer's window as a (left, right) pair in a per-layer list (`sliding_windows`, as
transformers' Moonshine Streaming config holds it): `right` future frames may be seen. Conventions differ on the left
(whether it counts the query's own key), not on the right: `right` keys after the query. Where the layer's mask lets
every real query with `right` real keys ahead of it see exactly `right - 1` of them, the look-ahead is one frame short
(transformers#46305: `-dist < right_window_size` for `<=`). Quiet where it sees `right` of them, on a causal layer
(right 0), and where the list is not one pair per layer.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import _index, _placed
from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.intent import intent
from maskcli.checks.registry import Rule
from maskcli.text import Finding

FIELD = "sliding_windows"


def _pair(windows, index) -> tuple[int, int] | None:
    if not isinstance(windows, (list, tuple)) or not isinstance(index, int) or not 0 <= index < len(windows):
        return None
    pair = windows[index]
    if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(type(x) is int for x in pair):
        return pair[0], pair[1]
    return None


def right_short(run: Run) -> list:
    """Layer calls whose real queries see one key fewer ahead than their stated right window."""
    found, done = [], set()
    for call in run.calls:
        if call.stored is None or call.shape[2] < 2:
            continue
        stated = intent(run, call)
        windows = stated.get(FIELD) if stated else None
        if windows is None:
            continue
        index = _index(run, call, stated)
        pair = _pair(windows, index)
        if pair is None or pair[1] < 1 or (call.mask, call.shape, pair) in done:
            continue
        done.add((call.mask, call.shape, pair))
        cells = keep(call)
        placed = None if cells is None else _placed(call, run, cells)
        if placed is None:
            continue
        right = pair[1]
        q, k = placed.own[:, None], placed.keys[None, :]
        seen, judged = placed.seen, placed.judged
        ahead = (k > q) & (k <= q + right)
        reach = np.broadcast_to(judged & ahead[None, None], seen.shape)
        full = reach.sum(axis=-1) == right  # (real queries with `right` real keys ahead of them)
        if not full.any():
            continue
        last = np.broadcast_to(judged & (k == q + right)[None, None], seen.shape)
        short = (seen & reach).sum(axis=-1) == right - 1
        if (short & full).sum() == full.sum() and not (seen & last).any(axis=-1)[full].any():
            missed = ~seen & last & full[..., None]
            b, h, qi, ki = first_cell(missed)
            source = stated.said(FIELD)
            found.append((call, Finding("window-right-short", (
                f"layer {index}: query {int(placed.own[qi])} does not see key {ki}, {right} ahead of it, though its "
                f"config states a look-ahead of {right} ({FIELD}[{index}]={pair}; {source}): every query sees {right - 1} "
                f"key{'' if right == 2 else 's'} ahead, one short (`<` for `<=`?)"), expected=f"{right} keys ahead", source=source,
                cell=(b, int(placed.own[qi]), ki))))
    return found


RULES = (
    Rule("window-right-short", "wrong", "steps", "a layer whose real queries see one key fewer ahead than the right "
         "(look-ahead) side of the (left, right) window its config states for it (sliding_windows)", right_short),
)
