"""A batch's key padding laid on the query axis: query i of every batch row is masked with batch row i's padding.

A (B, Lk) key padding handed to a kernel as it is (SDPA's 2-D `attn_mask`, a `masked_fill` of (B, Lk) against
(B, H, Lq, Lk) scores) broadcasts as (Lq, Lk): where B == Lq it runs, and query i of every clip is masked with clip
i's padding (lucidrains/vit-pytorch 4c89017: ViViT's temporal frame mask (b, f + 1) handed to SDPA unreshaped, where
`rearrange(mask, 'b j -> b 1 1 j')` was meant).

What makes the statement firm: a function of the program on the stack holds that padding (trace/held.py, read as
padding-unused reads it, per batch row over exactly this call's keys), its batch rows differ, and the mask the kernel
ran with is one plane for every batch row whose query row i is the padding's batch row i, every i: a batch row of its
own meets another row's padding on its queries, which the padding's own rows contradict. Said at the first cell where
query q of batch row b sees a key row b calls padding (or, else, hides a key row b calls real).

The padding may also be combined with a mask of the program's own (`mask &= padding`): the plane's query row i equals
the padding's row i on every key column where the padding's rows differ (Memformer ab3530e, its memory-update mask). Left alone:
a mask that differs between batch rows (the padding reached its rows: other rules read it), a padding
whose rows are all equal (any row is right), B != Lq, and a mask no query of which sees a later key (a causal triangle
over right-padded rows of lengths 1 .. B is that padding's table too: the causal mask is read first).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, triu
from maskcli.checks.held import readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def rows_on_queries(run: Run) -> list:
    """Calls whose one mask plane has, as query row i, the held padding's batch row i, while those rows differ."""
    found, done = [], {}
    for call in [*run.calls, *run.cross]:
        helds = call.details.get("held_padding")
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if not helds or call.stored is None or rows != q_len or rows < 2 or call.details.get("is_causal"):
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = _finding(call, helds, rows, k_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, helds: list, rows: int, length: int) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    plane = cells.any(axis=1)  # (b, Lq, Lk): a cell any head sees
    if not (plane == plane[:1]).all():
        return None  # (the mask differs by batch row: the padding reached the rows)
    plane = plane[0]
    if not triu(plane, 1).any():
        return None  # (no query sees a later key: a causal mask, read as one)
    ids = tuple(h["rows"] for h in helds if h["kind"] == "ids")
    for held in helds:
        for real in [*readings(held, rows, length, ids), *_behind_prefix(held, rows, length)]:
            if (real == real[:1]).all() or not _laid_on_queries(plane, real):
                continue
            cells = np.broadcast_to(plane, (rows, rows, length))  # (b, q, k): every batch row sees the plane
            bad = cells & ~real[:, None, :]
            bad = bad if bad.any() else ~cells & real[:, None, :]
            if not cross(call) and bad.shape[1] == length:  # (a real query's cell first, where the queries are the
                on_real = bad & real[:, :, None]  # keys' positions; a cross-attention's queries are not its keys')
                bad = on_real if on_real.any() else bad
            b, q, k = first_cell(bad)
            said = f"{held['name']} in {held['where']}"
            verb = "sees" if cells[b, q, k] else "does not see"
            calls = "padding" if cells[b, q, k] else "real"
            return Finding("batch-rows-on-queries", (
                f"batch row {b}: query {q} {verb} key {k}, which {said} calls {calls} in batch row {b}: the mask the "
                f"kernel ran with is one plane for every batch row whose query row i is batch row i of {held['name']} (a "
                f"({rows}, {length}) key padding broadcast as (queries, keys)), so every query is masked with another "
                f"batch row's padding — lay it on the keys: mask[:, None, None, :]"),
                expected=f"each batch row's keys masked by its own row of {held['name']}", source=said, cell=(b, q, k))
    return None


def _behind_prefix(held: dict, rows: int, length: int) -> list:
    """Lengths of fewer tokens than the call's keys read over its last keys, the keys before them all real: a memory
    or a cache of slots put before the tokens the lengths count (Memformer's memory slots before the source)."""
    found = held["rows"]
    if held["kind"] != "lengths" or found.size == 0 or not 1 <= found.min() < found.max() < length:
        return []
    prefix = length - int(found.max())
    return [np.concatenate([np.ones((rows, prefix), bool), real], axis=1)
            for real in readings(held, rows, int(found.max()))]


def _laid_on_queries(plane: np.ndarray, real: np.ndarray) -> bool:
    """Query row i of the one plane is the padding's batch row i: equal, or (a mask of its own combined with it, the
    padding `&=`-ed in) equal on every key column where the padding's rows differ, the rest the mask's own pattern
    (Memformer ab3530e: its (slots, slots + n) memory-update mask, each slot seeing itself and every source token,
    combined with the (batch, slots + n) source padding, batch == slots)."""
    if np.array_equal(plane, real):
        return True
    differ = ~(real == real[:1]).all(axis=0)
    return bool(differ.any()) and bool((plane[:, differ] == real[:, differ]).all())


RULES = (
    Rule("batch-rows-on-queries", "wrong", "call", "a (B, Lk) key padding the program holds, broadcast by the kernel "
         "as (Lq, Lk) with B == Lq: query i of every batch row masked with batch row i's padding (vit-pytorch 4c89017)",
         rows_on_queries),
)
