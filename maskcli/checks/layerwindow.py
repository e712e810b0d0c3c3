"""A sliding layer whose query sees fewer keys than its window allows of those the full layer of the same step sees.

The program states which layers slide and how far (a config's `sliding_window` with `layer_types`, checks/intent.py;
or its main module's constants, `SLIDING_WINDOW = 12` beside `LAYER_TYPES = ["sliding", "full"]`, trace/constants.py).
A sliding layer's mask is the full layer's cut to the window: within one model call, where the sliding layer's keys
are a subset of the full layer's for every real query (the same layout, read per batch row with padding resolved,
checks/real.py), a real query that sees fewer keys than min(the full layer's count, W) - 1 (one key of slack for the
conventions that count the query's own key or not) hides keys inside its window that it should read: wrong
(pytorch/executorch#14411: the QNN runner's KVManager advanced its row pointer only in SHIFT_POINTER mode, so in
SMART_MASK mode the sliding-window mask's rows 1..ar_len-1 of the next prefill chunk never saw the cached tokens).
Quiet where the sliding layer sees a key the full layer hides (another layout: nothing to compare), where the counts
agree with some window, on padding queries, and where no layer kind or window is stated.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep, layer, queries
from maskcli.checks.intent import intent
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding

SLIDING, FULL = ("sliding", "local"), ("full", "global")


def _kinds(run: Run, top, calls: list) -> tuple[int, str, dict, str] | None:
    """(W, what states it, {layer: "sliding" | "full"}, what states those) for the calls of one model call."""
    said = top.arguments.get("main_window"), top.arguments.get("main_layer_types")
    if said[0] and said[1]:
        (wname, size), (kname, kinds) = said
        return size, f"{wname} = {size}", dict(enumerate(kinds)), f"{kname} of the main module"
    for call in calls:
        stated = intent(run, call)
        window = stated.window() if stated else None
        if window is None:
            continue
        kinds = {}
        for other in calls:
            index = layer(other)
            kind = stated.kind(index) if index is not None else None
            if kind is not None:
                kinds[index] = kind[0]
        return window[0], f"{window[1]} = {window[0]}", kinds, "the config's layer kinds"
    return None


def _word(kind: str) -> str | None:
    low = str(kind).lower()
    return "sliding" if any(w in low for w in SLIDING) else "full" if any(w in low for w in FULL) else None


def sliding_short(run: Run) -> list:
    """Sliding-layer calls whose real queries see fewer keys than the window allows of the full layer's."""
    found, done = [], set()
    for top in run.tops:
        calls = [call for call in run.made_by(top) if call.stored is not None]
        if len(calls) < 2:
            continue
        said = _kinds(run, top, calls)
        if said is None:
            continue
        size, window_said, kinds, kinds_said = said
        by_kind: dict = {"sliding": {}, "full": {}}
        for call in calls:
            index = layer(call)
            word = _word(kinds.get(index, "")) if index is not None else None
            if word is not None:
                by_kind[word].setdefault(call.shape, (index, call))
        for shape, (index, call) in by_kind["sliding"].items():
            if shape not in by_kind["full"] or call.mask in done:
                continue
            hit = _short(call, by_kind["full"][shape][1], top, size)
            if hit is None:
                continue
            done.add(call.mask)
            b, q, seen, full, nearest = hit
            at = int(queries(call, top)[q])
            found.append((call, Finding("window-short", (
                f"layer {index} is a sliding layer ({kinds_said}: {kinds.get(index)!r}; {window_said}), yet batch row "
                f"{b}'s query {at} sees {seen} key{'s' if seen != 1 else ''} where layer {by_kind['full'][shape][0]}, "
                f"a full layer of the same step, sees {full}: the window allows {min(full, size)} of them, so keys "
                f"inside the window are hidden (key {nearest}, the nearest hidden one)"),
                expected=f"min({full}, {size}) keys", source=f"{window_said}, {kinds_said}", cell=(b, at, nearest))))
    return found


def _short(sliding, full, top, size: int) -> tuple | None:
    """(b, q, its keys, the full layer's, the last key it hides) of the first real query of `sliding` that sees fewer
    keys than its window allows of `full`'s, where `sliding` sees no key `full` hides; else None."""
    cs, cf = keep(sliding), keep(full)
    if cs is None or cf is None:
        return None
    rows = max(cs.shape[0], cf.shape[0])
    if cs.shape[0] not in (1, rows) or cf.shape[0] not in (1, rows):
        return None
    cs, cf = by_row(cs, rows), by_row(cf, rows)
    real = resolve(full, top, cf).queries
    if real.shape != cs.shape[:2]:
        return None
    if (cs & ~cf & real[:, :, None]).any():
        return None  # (the sliding layer sees a key the full one hides: another layout)
    if _bidirectional(cf, real):
        return None  # (a full encoder layer: its sliding layers' window is a band, not the W keys up to each query)
    n_s, n_f = cs.sum(-1), cf.sum(-1)
    bad = real & (n_s < np.minimum(n_f, size) - 1)
    if not bad.any():
        return None
    b, q = (int(i) for i in np.argwhere(bad)[0])
    nearest = int(np.flatnonzero(cf[b, q] & ~cs[b, q])[-1])  # (the newest of them: inside the window, whatever the layout)
    return b, q, int(n_s[b, q]), int(n_f[b, q]), nearest


def _bidirectional(cells: np.ndarray, real: np.ndarray) -> bool:
    """Every real query of each batch row sees the same keys, two or more real queries somewhere: a full layer that
    attends both ways (a causal one's first query sees fewer keys than its last), read in any layout of its columns."""
    many = False
    for b in range(cells.shape[0]):
        rows = cells[b][real[b]]
        if len(rows) > 1:
            many = True
            if not (rows == rows[:1]).all():
                return False
    return many


RULES = (
    Rule("window-short", "wrong", "batch", "a sliding layer whose query sees fewer keys than its window allows of "
         "those the full layer of the same step sees", sliding_short),
)
