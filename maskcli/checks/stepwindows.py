"""One call site whose prompt pass and decode steps lay sliding windows of different widths.

A call site is one layer of the program: its prompt pass (the first query at position 0, several queries) and its
decode steps (fewer queries than keys, behind a cache) attend through one layer's window. Where the prompt pass shows
a window of W keys (every real query of every batch row sees exactly the W keys up to its own, cut somewhere: steps.py's
`_window`, padding resolved first) and a decode step of the same site shows another width W' (its real queries see
exactly the W' keys up to their own, the window cut there too), the program states two windows for one layer, one of
them off: eole#340, whose prefill mask was `triu_(-sliding_window)` (W + 1 keys) while its cached decode kept
`position >= step - sliding_window + 1` (W keys), so a prompt's tokens attend one key more than the same tokens
decoded one at a time. (A decode step that sees further back than the prefill's window at all is window-lost.)

Quiet where either side's window never cuts (a prompt shorter than the window, a decode step before position W), where
both show one width, and on calls whose key columns are not positions (ring slots, cross-attention). The decode step
is read against the site's latest prompt pass that showed a window, the sequence it decodes or another one: one layer
has one window whichever sequence it attends. A site's decode window is read at its first decode step that shows one (a
later step wider than that is window-lost's).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep, runs
from maskcli.checks.real import by_row, resolve, stated
from maskcli.checks.registry import Rule
from maskcli.checks.steps import _window, prefill_once
from maskcli.text import Finding


def _shown(call, top, own: np.ndarray) -> int | None:
    """The window W every real query of the call sees (steps._window), None where it shows none."""
    cells = keep(call)
    if cells is None:
        return None
    real = resolve(call, top, by_row(cells, max(cells.shape[0], call.shape[0])), own_cells=True)
    return _window(np.broadcast_to(cells, (real.keys.shape[0], *cells.shape[1:])), own, real, call.stored)


def _each_sees(call, top, own: np.ndarray, width: int) -> bool:
    """What _shown says, window(width), read off the stored runs without a pass over the cells: where the mask keeps
    one run a row, every query of every row sees exactly the `width` keys up to its own, the window cuts keys off
    (its first key past 0), and the model call states no padding (rows alike read off the cells show none)."""
    found = runs(call.stored, call.shape[3])
    if found is None or not (own - width + 1 > 0).all() or stated(top, call.shape[0], call.shape[3]) is not None:
        return False
    starts, ends = found
    return bool(((ends == own + 1) & (ends - starts == width)).all())


def differing(run: Run) -> list:
    """(call, Finding) for the first decode step of each site whose window differs from its prompt pass's."""
    found, read = [], {}
    for where, calls in run.sites().items():
        head = width = None
        for call in calls:
            q_len, k_len = call.shape[2:]
            top, own, positions = run.placed(call)
            if not positions or call.details.get("slots") is not None or not len(own):
                continue
            key = (call.mask, call.shape, own.tobytes(), id(top))
            if own[0] == 0 and q_len >= 2:  # a prompt pass: its window as steps.py's sites read it (once a run)
                shown = prefill_once(run, call, top)
                if shown is not None and shown[1] is not None:
                    head, width = call, shown[1]
                continue
            if width is None or q_len >= k_len:
                continue
            if key not in read:
                read[key] = width if _each_sees(call, top, own, width) else _shown(call, top, own)
            other = read[key]
            if other is None:
                continue
            if other == width:
                break  # (the site's decode window is read at its first decode step that shows one: the prompt's)
            found.append((call, Finding("window-differs-at-decode", (
                f"step {head.step} of {head.where} is window({width}) (each prompt query sees the {width} keys up to its "
                f"own), but at step {call.step} query {int(own[0])} sees the {other} keys up to its own: one layer's "
                f"window laid {abs(width - other)} key{'' if abs(width - other) == 1 else 's'} "
                f"{'wider' if width > other else 'narrower'} at prefill than at decode (one of the two is off)"),
                expected=f"window({other}) as its decode steps lay it, or window({width}) at both",
                source=f"{where} at steps {head.step} and {call.step}", cell=(0, int(own[0]), int(own[0]) - width + 1))))
            break  # (each site said once)
    return found


RULES = (
    Rule("window-differs-at-decode", "wrong", "site", "a call site whose prompt pass lays a sliding window of another width "
         "than its decode steps (eole#340: triu_(-sliding_window) at prefill, W + 1 keys, where decode keeps W)",
         differing),
)
