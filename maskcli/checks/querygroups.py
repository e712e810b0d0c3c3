"""A Group-DETR self-attention whose query groups see each other.

Group DETR trains with G groups of object queries, each decoded on its own; a module stating G (`group_nums`,
`group_detr`, `num_query_groups`: trace/querygroups.py, the attention module or its decoder layer) says its
self-attention keeps the groups apart in training: a block-diagonal mask over the G * n queries of a row, or the
groups moved into the batch axis (B * G rows of n queries each). A training call whose rows are not a multiple of G
(the groups are not in the batch axis) over Lq = G * n queries of its own (Lq = Lk, n >= 2) holds the G groups in each
row, so a query may see at most its group's n keys, wherever the groups sit in the row; one that sees more sees
another group (detrex#238: the split into the batch axis, then a reshape with the pre-split (N, B), which interleaves
the groups back into one sequence, every group attending every other). Counted per batch row, head and query, after
any padding the kernel masked. Quiet in inference (one group is decoded: the split is a training device), where the
rows are a multiple of G (split into the batch: each row a group, or a batch of G images, not told apart), where Lq is
no multiple of G, and where every query sees at most n keys (a block-diagonal group mask, in any order).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def groups_leak(run: Run) -> list:
    """Per call site, its first training call whose query groups are in its rows and whose query sees another group."""
    found, done = [], set()
    for call in sorted((*run.calls, *run.unmasked), key=lambda c: c.index):
        stated = call.details.get("query_groups")
        if not stated or not stated.get("training") or call.where in done:
            continue
        rows, _, q_len, k_len = (int(x) for x in call.shape)
        groups, queries = int(stated["groups"]), stated.get("queries")
        if queries is not None:  # (a config states each group's queries: a row of G of them holds every group)
            if q_len != k_len or q_len != groups * int(queries):
                continue
        elif q_len != k_len or q_len % groups or q_len // groups < 2 or rows % groups == 0:
            continue
        n = q_len // groups
        if any(call is one for one in run.unmasked):
            seen = np.full((1, 1, q_len), k_len)
        else:
            cells = keep(call)
            if cells is None:
                continue
            seen = cells.sum(axis=-1)  # (b, h, Lq): the keys each query sees
        over = seen > n
        if not over.any():
            continue
        b, h, q = (int(x) for x in np.argwhere(over)[0])
        done.add(call.where)
        source = f"{stated['field']}={groups} of {stated['module']}"
        held = (f"{groups} x its {n} queries a group, {stated['field'].split('.')[0]}.num_queries: the groups folded "
                f"back into each row" if queries is not None else f"not a multiple of {groups}: the groups are not in "
                f"the batch axis")
        found.append((call, Finding("query-groups-leak", (
            f"{call.where} states {groups} query groups ({source}, in training), each decoded on its own, and attends "
            f"{q_len} queries a row over {rows} batch row{'s' if rows > 1 else ''} ({held}), so each row holds the "
            f"{groups} groups of {n} queries; but query {q} of "
            f"row {b} sees {int(seen[b, h, q])} keys, more than its group's {n}: the groups attend to each other "
            f"(the split into the batch undone, or never made?)"),
            expected=f"each query sees at most its group's {n} keys", source=source, cell=(b, q, 0))))
    return found


RULES = (
    Rule("query-groups-leak", "wrong", "call", "a Group-DETR self-attention in training (group_nums, group_detr) whose "
         "rows hold the query groups and whose query sees more keys than its group holds: the groups see each other",
         groups_leak),
)
