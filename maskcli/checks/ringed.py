"""The calls of a site whose cache stopped growing after it grew: a ring (or evicting) cache, its columns not positions.

A cache that keeps every key grows by each step's queries; a static one holds as many columns at every step. One that
grew and then, at a step that adds queries, holds no more keys than the step before it has overwritten or dropped a
slot: mlx-lm's BatchRotatingKVCache writes each new token over the oldest slot once the window is full, so the column
that held a row's left padding at the prefill holds a real token from then on, and a chunked prefill's step trims it back
to the window (more keys at the chunk, fewer after). Until the site's next pass of as many
queries as keys, its columns are slots, not the prefill's positions, and no rule may read a column as the same token
it was at the prefill (steps.py's padding-lost, padids.py's left-padding-attended: quiet-r141b, written blind, a
false alarm of both before).
"""

from __future__ import annotations

from maskcli.checks.context import Run


def rolled(run: Run) -> set:
    """Indices of the calls at or after a step of their site that added queries and no keys (or lost some), after the site's keys
    had grown since its latest pass of as many queries as keys; computed once a run."""
    held = run.__dict__.get("_rolled")
    if held is not None and held[0] is run.calls:
        return held[1]
    found = set()
    for calls in run.sites().values():
        last, grew, gone = None, False, False
        for call in calls:
            q_len, k_len = call.shape[2:]
            if q_len == k_len:
                last, grew, gone = k_len, False, False
                continue
            if last is not None and k_len > last:
                grew = True
            elif last is not None and grew and q_len and k_len <= last:
                gone = True
            if gone:
                found.add(call.index)
            last = k_len
    run.__dict__["_rolled"] = (run.calls, found)
    return found
