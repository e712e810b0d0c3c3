"""Tokens routed out of each row and attended causally in an order their positions do not follow (trace/routed.py).

A routing block (Mixture-of-Depths, a top-k token selection) gathers k of each row's L tokens and attends over them
with a causal mask built over the k it holds: query j sees keys 0..j. That mask is causal in the sequence only where
the gathered tokens sit in the order of their positions; the gather's index states the positions. Where, in some
batch row, the index is neither increasing nor decreasing (no order of the sequence: a reversed row is a backward
model's) and a query sees a key the gather took from a later position, a routed token attends to the future
(sramshetty/mixture-of-depths#5: `x.gather(1, argsort(topk_indices))`, a permutation of 0..k-1 and not the sorted
positions, under the block's `triu` mask). Wrong: the program's own gather and its own causal mask say so. Quiet
where the positions were sorted before the gather (the fix), where the mask is not causal over the k tokens (an
encoder over routed tokens sees them all: no order is claimed), and on a cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def routed_future(run: Run) -> list:
    """Each model call's first causal attention over routed tokens where a query sees a later-positioned token."""
    found = []
    for top in run.tops:
        routings = [entry for entry in top.permuted if "positions" in entry]
        for call in run.made_by(top) if routings else ():
            taken = _routed(routings, call)
            if taken is None or cross(call):
                continue
            cells = keep(call)
            if cells is None or not _causal(cells):
                continue
            hit = _future(cells, taken)
            if hit is not None:
                found.append((call, _finding(hit, taken)))
                break
    return found


def _routed(routings: list, call) -> dict | None:
    """The last routing before `call` that took as many tokens as the call's queries and keys, of its rows."""
    chosen = None
    for entry in routings:
        if entry["after"] > call.index:
            break
        rows, taken = entry["positions"].shape
        if call.shape[0] == rows and call.shape[2] == call.shape[3] == taken:
            chosen = entry
    return chosen


def _causal(cells: np.ndarray) -> bool:
    """The mask keeps no key after its query (by index) and each query's own key, on every row and head."""
    q_len = cells.shape[-1]
    above = np.triu(np.ones((q_len, q_len), dtype=bool), 1)
    return not cells[..., above].any() and bool(cells[..., np.arange(q_len), np.arange(q_len)].all())


def _future(cells: np.ndarray, entry: dict):
    """(b, q, k) of the first cell seen whose key was gathered from a later position than its query, in a row whose
    positions follow no order of the sequence; None where there is none."""
    positions = entry["positions"]
    seen = np.broadcast_to(cells.any(axis=1), (positions.shape[0], *cells.shape[-2:]))
    for b, row in enumerate(positions):
        steps = np.diff(row)
        if (steps > 0).all() or (steps < 0).all():
            continue  # (in the order of the sequence, or reversed: a backward model's)
        later = row[None, :] > row[:, None]  # [q, k]: the key's token sits after the query's
        hit = np.argwhere(seen[b] & later)
        if len(hit):
            return b, int(hit[0][0]), int(hit[0][1])
    return None


def _finding(hit: tuple, entry: dict) -> Finding:
    b, q, k = hit
    row = entry["positions"][b]
    return Finding("routed-sees-future", (
        f"batch row {b}: query {q} sees key {k} under a causal mask over the {len(row)} tokens a gather routed out of "
        f"{entry['length']}, but the gather took query {q} from position {int(row[q])} and key {k} from position "
        f"{int(row[k])}, later in the sequence: the routed tokens are not in the order of their positions "
        f"({', '.join(str(int(p)) for p in row[:12])}{', ...' if len(row) > 12 else ''}) — gather them by their sorted "
        "positions"), expected="the causal mask over the routed tokens' positions",
        source="the routing gather's index", cell=(b, q, k))


RULES = (
    Rule("routed-sees-future", "wrong", "steps", "tokens routed out of each row by a gather (Mixture-of-Depths, top-k "
         "selection) in an order their positions do not follow, attended with a causal mask over the routed order: "
         "routed tokens see later tokens", routed_future),
)
