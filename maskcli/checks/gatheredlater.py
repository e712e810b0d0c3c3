"""A branch whose keys are gathered per query position (selected blocks) that keeps more of them for a query at p than
the p + 1 positions 0 .. p, beside a causal branch over the same positions in the same run.

Native sparse attention's fine branch scores each query against the keys of the blocks it selected, gathered per
position (`einsum("bhgid,bhijd->bhgij")`: trace/layouts.py reads the grouped heads as its queries and folds the
positions among the heads, checks/handed.py's `_gathered`), so its key columns are slots, not positions, and no cell
says which key a slot holds. But a query at position p of a causal sequence has p + 1 keys at or before it: a query
that keeps more slots than that sees a later key, or the same key twice. The program states causality by its other
branches of the same run (trace/windows.py's window_frame: the run of the module holding the window, its sliding
branch; or the calls of the same module next to it): a square call over as many queries whose real rows see no later
key and each their own. The position of each folded plane is read off the lead axis whose size is that branch's query
count. *Suspicious*, with the condition named: whether two slots hold the same key is in the gathered values, which
maskcli does not read (lucidrains/native-sparse-attention-pytorch 36837b2: interpolated importance scores select the
still-future blocks, whose keys the fine branch keeps with no causal mask on selected blocks). Padding query rows (as
the causal branch reads them) are left alone.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding

NEAR = 4  # calls of the same module within this many of the gathered one, where no run is recorded


def _gathered(call) -> tuple | None:
    """(B, N, R) of a call an einsum laid out whose head axis N * R folds more planes than the heads its module states
    (checks/handed.py's reading), else None."""
    lead, heads = call.details.get("lead"), call.details.get("stated_heads")
    if "axes" not in call.details or not lead or len(lead) != 3 or heads is None or call.shape[1] <= heads:
        return None
    return tuple(int(x) for x in lead)


def _causal(run: Run, call) -> np.ndarray | None:
    """The real query rows (B, L) of a square call whose real rows see no later key and each its own; else None."""
    cells = keep(call)
    if cells is None or call.shape[2] != call.shape[3] or call.shape[2] < 2:
        return None
    rows = by_row(cells, call.shape[0] if cells.shape[0] in (1, call.shape[0]) else None)
    real = resolve(call, run.top(call), rows)
    n = call.shape[2]
    later = np.triu(np.ones((n, n), dtype=bool), 1)
    mine = real.queries
    if (rows & later[None] & mine[:, :, None]).any() or not rows[:, np.arange(n), np.arange(n)][mine].all():
        return None
    return mine


def _sibling(run: Run, call, length: tuple) -> tuple | None:
    """(the causal branch, its real query rows) of the same run over one of `length` queries."""
    frame = call.details.get("window_frame")
    for other in run.calls:
        if other is call or other.shape[2] not in length:
            continue
        if frame is not None:
            if other.details.get("window_frame") != frame:
                continue
        elif not (other.where == call.where or other.where.startswith(call.where + ".")) \
                or abs(other.index - call.index) > NEAR:
            continue
        mine = _causal(run, other)
        if mine is not None:
            return other, mine
    return None


def outnumber(run: Run) -> list:
    """A query at p keeping more gathered slots than p + 1, beside a causal branch of the same run."""
    found, said = [], set()
    for call in run.calls:
        lead = _gathered(call)
        if lead is None or (call.mask, call.shape) in said:
            continue  # (said once for the layers that gather alike)
        batch, n, r = lead
        sibling = _sibling(run, call, (r, n))
        cells = keep(call)
        if sibling is None or cells is None or call.shape[0] != batch:
            continue
        other, mine = sibling
        length = other.shape[2]
        if mine.shape[0] not in (1, batch):
            continue
        planes = np.arange(n * r)
        position = planes % r if r == length else planes // r  # (the lead axis as long as the causal branch's queries)
        kept = np.broadcast_to(cells, call.shape).sum(axis=-1)  # (B, planes, queries): slots kept
        real = np.broadcast_to(mine, (batch, length))[:, position]  # (B, planes)
        over = (kept > position[None, :, None] + 1) & real[:, :, None]
        if not over.any():
            continue
        said.add((call.mask, call.shape))
        order = np.lexsort((np.nonzero(over)[1], position[np.nonzero(over)[1]], np.nonzero(over)[0]))
        b, plane, g = (int(x[order[0]]) for x in np.nonzero(over))
        p, count = int(position[plane]), int(kept[b, plane, g])
        folded = over.any(axis=2).reshape(batch, n, r)  # (B, N, R): the queries over, per batch row and position
        rows = int(folded.any(axis=1).sum() if r == length else folded.any(axis=2).sum())
        found.append((call, Finding("gathered-keys-outnumber-past", (
            f"{call.where} step {call.step} scores keys gathered per position ({call.shape[3]} slots a query, laid out "
            f"by its einsum: {n} x {r} planes, one per head group and position) beside a causal branch of the same run "
            f"({other.where} step {other.step}: each real query sees its own key and no later one); but the query at "
            f"position {p} of batch row {b} keeps {count} slots, more than the {p + 1} positions 0 .. {p} ({rows} such "
            f"queries): at least {count - p - 1} of them hold later keys, unless the same key was gathered twice "
            f"(selected blocks with no causal mask, or chosen past the query's own block?)"),
            expected=f"at most {p + 1} keys for the query at position {p}, as its causal branch keeps",
            source=f"{other.where} step {other.step}: the causal branch of the same run",
            cell=(b, p, None))))
    return found


RULES = (
    Rule("gathered-keys-outnumber-past", "suspicious", "call", "a branch whose keys are gathered per position "
         "(selected blocks) keeps more slots for a query at p than the p + 1 positions 0 .. p, beside a causal branch "
         "of the same run: later keys selected, unless a key was gathered twice (native-sparse-attention-pytorch "
         "36837b2)", outnumber),
)
