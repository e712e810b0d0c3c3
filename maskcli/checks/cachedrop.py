"""A query behind a sliding cache that sees fewer keys than the same site's one pass over the same tokens shows it.

A call site fed a sequence step by step behind its cache (a first pass from an empty cache, then calls whose keys
outnumber their queries: decode steps, a next turn's chunk) and, at another step, the same token ids again in one
pass from an empty cache (a reference the program checks itself against: the model call's token ids, else those the
function holding the mask was handed, prefill.py's `_ids`) states what each position sees at that layer: the one
pass's window. A query of the cached run placed by the tokens fed before it (the ids put together equal the one
pass's first ones, so its position is known whatever the cache's columns are: ring slots, trimmed buffers) that sees
fewer keys than the one pass shows the same position is missing keys still inside its window: the cache dropped
them (ollama#15591: after the ring buffer wrapped, a multi-token update sliced the buffer to its first slots, so the
next turn's first query saw 4 keys where its window holds 8).

Read only where the one pass lays a window (steps.py's `_window`: every real query sees exactly the W keys up to its
own, cut somewhere), per batch row, the heads folded; quiet where the cached run's keys outnumber the tokens fed (no
one sequence), where the ids differ, and on a query that sees as many keys as the one pass or more (window-lost's).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.prefill import _ids, _slots
from maskcli.checks.registry import Rule
from maskcli.checks.steps import prefill_once
from maskcli.text import Finding


def _passes(run: Run, slot: list) -> list:
    """(call, ids (B, L), counts (B, L): keys each position sees) of the slot's one passes that lay a window."""
    found = []
    for call in slot:
        q_len, k_len = call.shape[2:]
        top = run.top(call)
        ids = _ids(top, call)
        if q_len < 2 or q_len != k_len or ids is None or ids.shape[1] != q_len:
            continue
        shown = prefill_once(run, call, top)
        cells = keep(call)
        if shown is None or shown[1] is None or cells is None or cells.shape[0] not in (1, ids.shape[0]):
            continue
        counts = np.broadcast_to(cells.any(axis=1).sum(axis=-1), (ids.shape[0], q_len))
        found.append((call, ids, counts, shown[1]))
    return found


def dropped(run: Run) -> list:
    """(call, Finding) for the first cached call of each site whose query sees fewer keys than the one pass shows."""
    found = []
    for where, calls in run.sites().items():
        if len(calls) < 3:
            continue
        hit = None
        for slot in _slots(run, sorted(calls, key=lambda call: call.index)):
            passes = _passes(run, slot)
            if not passes:
                continue
            fed, ids = None, []
            for call in slot:
                q_len, k_len = call.shape[2:]
                given = _ids(run.top(call), call)
                if given is None or given.shape[1] != q_len or (ids and given.shape[0] != ids[0].shape[0]):
                    fed, ids = None, []
                    continue
                if q_len == k_len:  # a pass from an empty cache: a sequence starts
                    fed, ids = q_len, [given]
                    continue
                if fed is None or k_len > fed + q_len:
                    fed, ids = None, []  # (keys the tokens fed do not account for: no one sequence)
                    continue
                start, fed = fed, fed + q_len
                ids.append(given)
                hit = _fewer(call, start, np.concatenate(ids, axis=1), passes)
                if hit is not None:
                    found.append(hit)
                    break
            if hit is not None:
                break
    return found


def _fewer(call, start: int, ids: np.ndarray, passes: list):
    """(call, Finding) where a query of `call` (its first at position `start`) sees fewer keys than a one pass over the
    same ids shows its position; None where none does."""
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, ids.shape[0]):
        return None
    length = ids.shape[1]
    seen = np.broadcast_to(cells.any(axis=1).sum(axis=-1), (ids.shape[0], call.shape[2]))  # (B, Lq)
    for one, given, counts, width in passes:
        if one is call or given.shape[1] < length or not np.array_equal(given[:, :length], ids):
            continue
        shown = counts[:, start:length]
        fewer = seen < shown
        if not fewer.any():
            continue
        b, i = (int(x) for x in np.argwhere(fewer)[0])
        p = start + i
        return call, Finding("window-keys-dropped", (
            f"query {p} of batch row {b} (step {call.step}, query {i} of its {call.shape[2]} behind the cache) sees "
            f"{int(seen[b, i])} keys, but the same call site's one pass over the same token ids (step {one.step}, "
            f"window({width})) shows position {p} {int(shown[b, i])} keys: the cache dropped keys still inside the "
            f"window ({int(fewer.sum())} queries short)"),
            expected=f"window({width}), as the one pass over the same tokens", source=f"{one.where} at step {one.step} "
            f"over the same token ids")
    return None


RULES = (
    Rule("window-keys-dropped", "wrong", "site", "a query behind a sliding cache that sees fewer keys than the same "
         "site's one pass over the same token ids shows its position (ollama#15591: a wrapped ring buffer sliced to "
         "its first slots before a multi-token update)", dropped),
)
