"""A query that sees more keys than the window of the cache object whose method hands the kernel its keys.

A cache bounded to the last W tokens states it on itself: VeloxQuant's `SlidingWindowKVCache(inner, window_size=4)`,
whose `attend(q)` hands the kernel the keys it keeps (trace/bounded.py reads the object's int `window_size` /
`sliding_window` W, and the count of sink tokens it holds beside it, where a method of it is on the way to the kernel).
Such a cache keeps W keys (W + 1 by another convention) and its sinks; a query that sees more than W + 1 + sinks keys in
every head attends to keys the cache says it has let go: its eviction kept the old keys (VeloxQuant-MLX#274: the inner
cache's reset was gated on an attribute no cache has, so the window was re-appended on top of the whole history, and
decode attended over 8, 12, ... 28 keys while `len(cache)` said 4).

Read per batch row and query, in every head (a head-specific mask says nothing of the cache); quiet on a
cross-attention, where the object names a sink count that is not an int, and where no query sees that many keys.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def overrun(run: Run) -> list:
    """(call, Finding) for the first call of each site whose query sees more keys than its cache object's window."""
    found, done = [], set()
    for call in run.calls:
        said = call.details.get("window_bounded")
        if not said or len(said) != 4 or call.stored is None or call.where in done:
            continue
        name, window, sinks, where = str(said[0]), int(said[1]), int(said[2]), str(said[3])
        most = window + 1 + sinks
        if call.shape[3] <= most or cross(call):
            continue
        cells = keep(call)
        if cells is None:
            continue
        seen = cells.sum(axis=-1).min(axis=1)  # (b, Lq): the keys each query sees in every head
        over = seen > most
        if not over.any():
            continue
        b, q = (int(i) for i in np.argwhere(over)[0])
        got = int(seen[b, q])
        done.add(call.where)
        found.append((call, Finding("cache-window-overrun", (
            f"{where}: the cache the kernel reads keeps the last {window} keys ({window} or {window + 1} by its "
            f"convention{f', and {sinks} sink tokens' if sinks else ''}), but query {q} of batch row {b} sees {got} keys "
            f"in every head (step {call.step}, {int(over.sum())} such queries): the cache kept keys it lets go"),
            expected=f"at most {most} keys", source=where, cell=(b, q, 0))))
    return found


RULES = (
    Rule("cache-window-overrun", "wrong", "call", "a query sees more keys than the window (and sinks) of the cache "
         "object whose method hands the kernel its keys: its eviction kept old keys (VeloxQuant-MLX#274)", overrun),
)
