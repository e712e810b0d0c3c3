"""A heavy-hitter KV cache's decode query that sees more keys than the heavy and recent budgets the module states.

H2O keeps, at each decode step, the `heavy_budget` cached keys of the largest accumulated attention and the
`recent_budget` latest ones (read from the module's own attributes, trace/evictbudget.py): its eviction mask over the
cache keeps at most heavy_budget + recent_budget keys per head, the new token's own among the recent ones. A single
decode query whose mask keeps more, in some batch row and head, attends keys the cache says it evicted
(FMInference/H2O PR #34: the next step's mask was a view of the one `score_mask[:, -recent_budget:] = 1` then wrote
into, one key more per step, and with recent_budget 0 the heavy-only branch never zeroed it: every key kept).

Counted per batch row, head and query in the keys the mask keeps (padding it hides only lowers the count); only
single-query steps whose keys outnumber the budget (a prefill attends its whole prompt before anything is evicted);
quiet on cross-attention; the innermost module that states a budget speaks for the calls under it.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.intent import stated_for
from maskcli.checks.registry import Rule
from maskcli.text import Finding

FLAG = "evict_budget"


def over_evict_budget(run: Run) -> list:
    """Single-query calls under a module that states a heavy-hitter budget, a query of which keeps more keys."""
    found, done = [], {}
    for top in run.tops:
        if not any(FLAG in one.fields for one in getattr(top, "stated", ())):
            continue
        for call in run.made_by(top):
            if call.shape[2] != 1:
                continue
            said = [one for one in stated_for(top, call.where) if FLAG in one.fields]
            if not said:
                continue
            inner = max(said, key=lambda one: len(one.scope or ""))
            heavy, recent = inner.fields[FLAG]
            if call.shape[3] <= heavy + recent or cross(call):
                continue
            key = (call.mask, call.shape, heavy, recent)
            if key not in done:
                done[key] = _finding(call, heavy, recent, inner.source)
            if done[key] is not None:
                found.append((call, done[key]))
    return found


def _finding(call, heavy: int, recent: int, source: str) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    budget = heavy + recent
    seen = cells.sum(axis=-1)  # (b, h, 1)
    if seen.max() <= budget:
        return None
    b, h, q = (int(x) for x in np.unravel_index(int(np.argmax(seen)), seen.shape))
    count, k_len = int(seen[b, h, q]), call.shape[3]
    k = int(np.flatnonzero(cells[b, h, q])[0])
    return Finding("evicted-keys-attended", (
        f"batch row {b}, head {h}: the decode query sees {count} of {k_len} keys, while {source} keeps "
        f"{heavy} heavy-hitter and {recent} recent keys ({budget}) in the cache: the eviction mask keeps keys the cache "
        f"evicted (a mask aliased by the one the scores were kept with, or never cleared?)"),
        expected=f"at most {budget} keys per query ({heavy} heavy + {recent} recent)", source=source,
        cell=(b, call.shape[2] - 1, k))


RULES = (
    Rule("evicted-keys-attended", "wrong", "steps", "a decode query of a heavy-hitter (H2O) KV cache sees more keys "
         "than the `heavy_budget` + `recent_budget` its module states (the eviction mask aliased by the scores' mask "
         "or never zeroed)", over_evict_budget),
)
