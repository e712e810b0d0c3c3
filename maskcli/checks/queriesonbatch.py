"""A 2-D (queries, keys) mask grown to 4-D on the wrong side: its query axis laid on the batch axis.

A (Lq, Lk) mask the program holds (`attention_mask` / `mask`, 1 = seen, trace/held.py) is meant for every batch row
alike: `mask[None, None]`. Grown with `unsqueeze(1)` twice instead, it is (Lq, 1, 1, Lk): where B == Lq it runs, and
every query of batch row b is masked with the mask's query row b (keras-team/keras#20488: MultiHeadAttention's fused
path expanded a (T, S) mask on axis 1 and tiled it over the heads, so batch element b got row b for every query).

What makes the statement firm that the held mask is (queries, keys) and not a (B, Lk) key padding, which the kernel's
mask would then be right to repeat over the queries: some row of it is not one run of seen keys at an edge (a band, a
block, a causal triangle cut by a window: no padding is laid that way), or the same call site, called elsewhere,
held the same mask spelled 3-D under the same name, (B, Lq, Lk) with every batch row that plane. (A square one
must let every query see its own position, as a (queries, keys) mask does: a (B, L) mask with holes need not.) The
mask the kernel ran with is then, in every batch row b, the held mask's row b for every query, while the held rows
differ: a query of batch row b sees what query b is allowed, not what its own row says.

Left alone: a held mask whose rows are all equal (repeating any row is right), a held (B, Lk) padding table with no
3-D spelling at its site (which it is, nothing says), a kernel mask that differs between the queries of a batch row
(the plane reached the queries), and B != Lq (the broadcast fails or lays it elsewhere).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _runs(plane: np.ndarray) -> bool:
    """Every row of a bool (Lq, Lk) plane is one run of True at an edge (or none): a padding table could be it."""
    count = plane.sum(axis=1)[:, None]
    at = np.arange(plane.shape[1])[None, :]
    return bool(((plane == (at < count)) | (plane == (at >= plane.shape[1] - count))).all())


def _spelled_3d(run: Run, where: str, name: str, plane: np.ndarray) -> bool:
    """Some call of the site `where` held a (B, Lq, Lk) mask named `name` whose every batch row is `plane`."""
    for other in [*run.calls, *run.cross]:
        if other.where != where:
            continue
        for held in other.details.get("held_padding") or ():
            rows = held["rows"]
            if held["kind"] == "cells" and held["name"] == name and rows.ndim == 3 and rows.shape[1:] == plane.shape \
                    and (rows.astype(bool) == plane).all():
                return True
    return False


def queries_on_batch(run: Run) -> list:
    """Calls whose mask is, in batch row b, the held (Lq, Lk) mask's query row b for every query."""
    said: dict = {}  # (mask, shape, site, held masks) -> Finding or None: one reading for the calls of one mask

    def judged(call, helds: list) -> Finding | None:
        key = (call.mask, call.shape, call.where, tuple(id(h["rows"]) for h in helds))
        if key not in said:
            said[key] = _finding(run, call, helds, call.shape[0], call.shape[3])
        return said[key]

    return [(call, finding) for call in [*run.calls, *run.cross]
            if call.details.get("held_padding") and call.stored is not None and call.shape[0] == call.shape[2] > 1
            and (finding := judged(call, call.details["held_padding"])) is not None]


def _finding(run: Run, call, helds: list, rows: int, length: int) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    plane = np.broadcast_to(cells.any(axis=1), (rows, call.shape[2], length))  # (b, Lq, Lk): a cell any head sees
    if not (plane == plane[:, :1]).all():
        return None  # (the queries of a batch row differ: the mask reached the query axis)
    for held in helds:
        given = held["rows"]
        if held["kind"] != "keep" or given.shape != (rows, length) or (given == given[:1]).all():
            continue
        if not np.array_equal(plane[:, 0], given):
            continue  # (batch row b is not the held mask's row b)
        as_3d = _spelled_3d(run, call.where, held["name"], given)
        if not as_3d and (_runs(given) or given.shape[0] == given.shape[1] and not given.diagonal().all()):
            continue  # (a padding table, repeated over the queries as it should be; a square plane some query of
            # which does not see its own position is as likely a (B, L) mask with holes)
        wrong = np.broadcast_to(given, plane.shape) != plane  # (b, q, k): the held plane against what the kernel ran
        seen = wrong & plane
        b, q, k = first_cell(seen if seen.any() else wrong)
        said = f"{held['name']} in {held['where']}"
        why = (f"the same call site was handed it as ({rows}, {rows}, {length}), this plane in every batch row"
               if as_3d else "its rows are not runs of seen keys at an edge, so it is no key padding")
        return Finding("queries-on-batch", (
            f"batch row {b}: query {q} {'sees' if plane[b, q, k] else 'does not see'} key {k}, which query {q}'s row of "
            f"{said}, a ({rows}, {length}) (queries, keys) mask ({why}), {'hides' if plane[b, q, k] else 'shows'}: the "
            f"mask the kernel ran with gives every query of batch row b that mask's query row b, its query axis laid on "
            f"the batch axis (grown with unsqueeze(1) where mask[None, None] was meant)"),
            expected=f"every batch row masked with the whole ({rows}, {length}) plane of {held['name']}", source=said,
            cell=(b, q, k))
    return None


RULES = (
    Rule("queries-on-batch", "wrong", "call", "a (Lq, Lk) mask the program holds, grown so that its query axis lands on "
         "the batch axis (B == Lq): every query of batch row b masked with the mask's query row b "
         "(keras-team/keras#20488)", queries_on_batch),
)
