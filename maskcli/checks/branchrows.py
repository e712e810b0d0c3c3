"""A branch over keys fewer than its queries (blocks summarised from the sequence) whose queries see the blocks after
them, beside a causal branch over the same queries.

Native sparse attention (and its kin: a compressed branch, a pooled or strided one) attends one set of queries twice or
more: to the sequence itself (a sliding window, causal) and to Lk < Lq keys made of its blocks, block j summarising
tokens that end later the larger j is. Causally, a query sees the blocks that have ended by its position: a key column
is seen from some query on, and a later query sees every block an earlier one sees. Where the same queries (the same
query tensor, trace/queried.py) go to a self-attention whose mask is causal (no query sees a later key, each sees its
own: query i sits at position i), a mask over the blocks whose columns are each seen by the first queries only (key j
by rows 0 .. t_j - 1, t_j growing with j), query 0 seeing several keys and a later query fewer, sees the blocks that
end after each query and hides those that have ended: the reverse of a causal branch, a keep mask read the other way
round (tilde-research/nsa-release#3: `q_idx < kv_idx * stride + block_size - 1` handed to FlexAttention, which keeps
where it is True). Query 0, at position 0, may see at most one key of distinct positions; it sees them all.

Read per batch row and head; quiet where the columns are seen from some query on (the fix), where the sibling branch
is not causal or not over the same queries, and where every query sees every key (memory before the sequence).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _causal(call) -> bool:
    """The call's mask keeps each query's own key and no later one, in every batch row and head."""
    cells = keep(call)
    if cells is None or cells.shape[2] != cells.shape[3]:
        return False
    n = cells.shape[2]
    later = band(n, n, 1, True)
    return not cells[..., later].any() and bool(cells[..., np.arange(n), np.arange(n)].all())


def _reversed(plane: np.ndarray) -> np.ndarray | None:
    """t (one per key) where each key column of `plane` (Lq, Lk) is seen by rows 0 .. t_j - 1 exactly, t growing with
    j, row 0 seeing two keys or more and the last row fewer than row 0; None otherwise."""
    q_len = plane.shape[0]
    t = plane.sum(axis=0)
    rows = np.arange(q_len)[:, None]
    if not np.array_equal(plane, rows < t[None, :]) or np.any(np.diff(t) < 0):
        return None
    if int(plane[0].sum()) < 2 or int(plane[-1].sum()) >= int(plane[0].sum()):
        return None
    return t


def blocks_after(run: Run) -> list:
    """(call, Finding) for each call over fewer keys than queries that sees, per query, the blocks after it, beside a
    causal branch over the same queries."""
    found, said = [], set()
    calls = list(run.calls) + list(run.cross)
    causal: dict = {}
    for call in calls:
        q_len, k_len = call.shape[2:]
        given = call.details.get("query_tensor")
        if given is not None and q_len == k_len and q_len > 1:
            causal.setdefault(repr(given), []).append(call)
    for call in sorted(calls, key=lambda c: c.index):
        q_len, k_len = call.shape[2:]
        given = call.details.get("query_tensor")
        if given is None or not 1 < k_len < q_len or call.where in said:
            continue
        sibling = next((other for other in causal.get(repr(given), ()) if other.shape[2] == q_len and _causal(other)),
                       None)
        cells = keep(call)
        if sibling is None or cells is None:
            continue
        hit = None
        for b in range(cells.shape[0]):
            for h in range(cells.shape[1]):
                t = _reversed(cells[b, h])
                if t is not None:
                    hit = hit or (b, h, t)
        if hit is None:
            continue
        b, h, t = hit
        said.add(call.where)
        seen = ", ".join(f"key {j} by queries 0 .. {int(n) - 1}" if n else f"key {j} by none" for j, n in enumerate(t[:4]))
        found.append((call, Finding("blocks-seen-before-they-end", (
            f"{call.where} step {call.step} attends the queries of a causal branch ({sibling.where} step {sibling.step}, "
            f"the same query tensor: query i at position i, seeing keys up to its own) to {k_len} keys, fewer than its "
            f"{q_len} queries (blocks made of the sequence); but each key is seen by the first queries only ({seen}"
            f"{', ...' if len(t) > 4 else ''}): query 0 sees {int(cells[b, h, 0].sum())} keys and query {q_len - 1} "
            f"{int(cells[b, h, -1].sum())}. Each query sees the blocks that end after it and hides those that have "
            f"ended: the reverse of a causal branch (a keep mask read the other way round: a mask_mod's comparison "
            f"turned)"),
            expected="each key seen from the query where its block ends on (a later query sees what an earlier one sees)",
            source=f"{sibling.where} step {sibling.step}: the causal branch over the same queries",
            cell=(b, 0, int(np.flatnonzero(cells[b, h, 0])[-1])))))
    return found


RULES = (
    Rule("blocks-seen-before-they-end", "wrong", "steps", "a branch over keys fewer than its queries (compressed "
         "blocks) whose queries each see the blocks after them, beside a causal branch over the same queries "
         "(tilde-research/nsa-release#3: a compressed branch's mask_mod the wrong way round)", blocks_after),
)
