"""A call whose keys were sliced off the tail of the cache, so that its first queries lose keys inside the window the
same layer lays at its prompt pass.

A layer that slices its cache's keys to its mask's key axis hands the kernel the last Lk keys of a longer key tensor
(trace/sliced.py: "keys_sliced" = (start, length), the keys being positions start .. length - 1). Its queries are the
newest tokens, the last Lq of those positions. Where the same call site's prompt pass (the first query at position 0,
several queries) shows a sliding window of W keys (every real query sees exactly the W keys up to its own, cut
somewhere: steps.py's `_window`), a query at position p of this call should see min(W, p + 1) keys, back to
p - W + 1. A query that sees the run of keys from the first one handed (position start) up to its own, fewer than
that, while its window reaches before `start`, lost keys the program holds and its own layer's window keeps: the
mask and the keys were cut for a cache trimmed to the window, over a cache that keeps every key (lablup/mlxcel#418:
the clamped `[size, window]` prefill mask over a dense KVCache; the second prefill chunk's first query saw 1 key of
its window of 4). The same where the cache is trimmed to the window before a multi-token chunk attends
(rasbt/LLMs-from-scratch#1013: `cache_k[:, -W:]` after the chunk's keys were joined, the chunk's first queries losing
keys of their window; keys read off the tile's key span, trace/tiled.py, where the cache is laid (B, L, H, D)).

Read per batch row and query in every head; quiet on a cross-attention, where the site's prompt pass shows no window
(nothing says W), and where a query's run does not start at the first key handed (padding, or another cut).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.checks.stepwindows import _shown
from maskcli.text import Finding


def sliced(call) -> tuple | None:
    """(start, length) of the keys a call was handed as the tail of a longer key tensor: trace/sliced.py's
    "keys_sliced", or the key span of trace/tiled.py's "tile" where only the keys are cut, to a tail (a cache laid
    (B, L, H, D), sliced on its length and turned to (B, H, D, L) for q @ kᵀ: LLMs-from-scratch's `cache_k[:, -W:]`)."""
    said = call.details.get("keys_sliced")
    if said:
        return tuple(int(x) for x in said)
    part = call.details.get("tile")
    if not part or len(part) != 3:
        return None
    (b0, rows), (q0, queries), (start, length) = part
    if b0 or rows != call.shape[0] or q0 or queries != call.shape[2] or start <= 0 or start + call.shape[3] != length:
        return None
    return int(start), int(length)


def _window(run: Run, calls: list) -> tuple | None:
    """(call, W) of the site's latest prompt pass before the sliced call that shows a window, else None."""
    found = None
    for call in calls:
        if sliced(call):
            break
        q_len = call.shape[2]
        top, own, positions = run.placed(call)
        if not positions or not len(own) or own[0] != 0 or q_len < 2 or call.details.get("slots") is not None:
            continue
        width = _shown(call, top, own)
        if width is not None:
            found = (call, width)
    return found


def sliced_window(run: Run) -> list:
    """(call, Finding) for the first sliced call of each site whose queries lose keys inside the site's window."""
    found = []
    for where, calls in run.sites().items():
        if not any(sliced(call) for call in calls):
            continue
        for i, call in enumerate(calls):
            said = sliced(call)
            if not said or cross(call):
                continue
            start, length = said
            q_len, k_len = call.shape[2:]
            if k_len != length - start or q_len > k_len:
                continue
            head = _window(run, calls[:i])
            cells = keep(call)
            if head is None or cells is None:
                continue
            width = head[1]
            seen = cells.all(axis=1) if cells.shape[1] > 1 else cells[:, 0]  # (b, Lq, Lk): seen in every head
            hit = None
            for b in range(seen.shape[0]):
                for q in range(min(q_len, seen.shape[1])):
                    p = length - q_len + q
                    row = seen[b, q]
                    want = min(width, p + 1)
                    got = int(row.sum())
                    own = p - start  # (its own key's column)
                    if got == 0 or got >= want or p - width + 1 >= start or not row[0] \
                            or not row[:own + 1].all() or row[own + 1:].any():
                        continue
                    hit = hit or (b, q, p, got, want)
            if hit is None:
                continue
            b, q, p, got, want = hit
            found.append((call, Finding("window-keys-sliced", (
                f"step {head[0].step} of {where} is window({width}) (each prompt query sees the {width} keys up to its "
                f"own), but at step {call.step} the kernel is handed the last {k_len} of {length} cached keys "
                f"(positions {start} .. {length - 1}) and the query at position {p} (batch row {b}) sees {got} key"
                f"{'s' * (got != 1)}, where its window holds {want}: keys {p - width + 1} .. {start - 1} are cached "
                f"and sliced off (the cache trimmed to the window before a chunk of several queries attends, or a mask "
                f"and keys cut for a trimmed cache over one that keeps them)"),
                expected=f"window({width}): {want} keys for the query at position {p}",
                source=f"{where} at steps {head[0].step} and {call.step}", cell=(b, p, max(0, p - width + 1)))))
            break  # (each site said once)
    return found


RULES = (
    Rule("window-keys-sliced", "wrong", "site", "a call handed the tail of its cache's keys whose first queries see "
         "fewer keys than the window its site lays at its prompt pass, the rest cached and sliced off "
         "(lablup/mlxcel#418: a clamped [size, window] mask over a dense cache)", sliced_window),
)
