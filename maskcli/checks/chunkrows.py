"""A layer whose cache holds a fixed number of keys (a ring) and whose chunked steps let each row see one key more.

A call site whose keys are the same number at every step (a ring or static cache) and whose steps each hand it
several queries: in each step, row k of batch row b sees c + k keys (the whole cache and the chunk's keys up to its
own), and the next step's first row sees c again, c >= 2. Causal attention over a cache that keeps every key gives
the next step's first row more keys than the last row of the step before (c + Lq at least: its keys grew); a sliding
window of W gives every row W once the window is full. A first row that sees as many keys as the first row before it
says the cache dropped the keys the chunk's later rows saw: a window of c keys, which the later rows of each chunk
over-attend (ExecuTorch's StaticAttentionMask, pytorch/executorch#21857: row k of a local layer's chunk sees cache_len
+ k + 1 keys), or a window of c + Lq - 1 whose cache was cut to the window before the chunk read it, so its first rows
under-attend (LLMs-from-scratch#1008: the sliding-window cache trimmed to W keys before a chunk of 3 attends). The
cells alone do not say which width the program meant: the finding names both.

Said only where a sibling layer of the same step holds more keys than this one (the program states this layer's
cache, smaller than its global layers', a local one): a segment-recurrent model's memory (Transformer-XL, the
Compressive Transformer) is a fixed-size cache every query of a segment sees whole by design. Quiet on a step whose counts do not grow
by one key a row (a tree of drafts, a window already full, chunked attention restarting within the step) and where
the first row sees one key (a new sequence, a chunk of chunked attention).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _first_counts(cells: np.ndarray) -> np.ndarray | None:
    """Int (B,): each batch row's first query's key count where every row k of it sees that count + k keys, the same
    in every head; None where any batch row does not."""
    counts = cells.sum(axis=-1)  # (B, H, Lq)
    if not (counts == counts[:, :1]).all():
        return None  # (heads that differ: not one chunk pattern)
    rows = counts[:, 0, :]
    if not (np.diff(rows, axis=-1) == 1).all():
        return None
    return rows[:, 0]


def overattend(run: Run) -> list:
    """(call, Finding) at each step of a fixed-size cache whose first row sees as many keys as the step before's."""
    found, counted = [], {}
    for where, calls in run.sites().items():
        before = None
        for call in calls:
            q_len, k_len = call.shape[2:]
            if q_len < 2 or q_len >= k_len:
                before = None
                continue
            key = (call.mask, call.shape)
            if key not in counted:
                cells = keep(call)
                counted[key] = None if cells is None else _first_counts(np.asarray(cells))
            first = counted[key]
            if first is None:
                before = None
                continue
            if before is not None and before[0].shape == call.shape and (first >= 2).all() \
                    and np.array_equal(first, before[1]):
                said = _finding(run, where, before[0], call, int(first[0]), q_len)
                if said is not None:
                    found.append((call, said))
            before = (call, first)
    return found


def _finding(run: Run, where: str, earlier, call, seen: int, q_len: int) -> Finding | None:
    """The finding where a sibling site of the same step holds more keys (the program made this layer's cache the
    local one), else None: Transformer-XL's and the Compressive Transformer's memories are fixed-size caches that
    every query of a segment sees whole, by design."""
    k_len = call.shape[3]
    wider = next((other for other in run.calls if other.step == call.step and other.where != where
                  and other.shape[2] == q_len and other.shape[3] > k_len), None)
    if wider is None:
        return None
    return Finding("chunk-rows-overattend", (
        f"at step {call.step} the first query sees {seen} keys, as at step {earlier.step}, but the last query of step "
        f"{earlier.step} saw {seen + q_len - 1}: rows of one chunk see windows of different widths over a cache of "
        f"fixed size, a window of {seen} keys the later rows see past, or one of {seen + q_len - 1} the cache cut "
        f"before the chunk's first rows read it"),
        expected=f"one window for every row: {seen} keys each, or {seen + q_len - 1} for the first rows too",
        source=f"{wider.where}, a layer of the same step, holds {wider.shape[3]} keys: this one's {k_len} is a local "
               f"layer's cache", cell=(0, q_len - 1, 0))


RULES = (
    Rule("chunk-rows-overattend", "wrong", "site", "a chunked prefill over a fixed-size (ring) cache whose later rows "
         "see the whole cache and the chunk's keys: more keys than the next chunk's first row", overattend),
)
