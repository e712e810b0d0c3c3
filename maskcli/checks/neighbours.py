"""A k-nearest-neighbour attention whose real nodes see fewer than k neighbours while their row has k real nodes.

A module that states its own k (`self.num_nearest_neighbors`: En-transformer's; trace/stated.py reads it, and none
where the module holds another reason to hide a neighbour: a finite `valid_radius`, `only_sparse_neighbors`) attends
each node over the k slots its ranking picked: a call with k keys and more queries than that. Where the batch's
padding held by the program's own frames (checks/held.py's readings over the queries: the nodes) has at least k real
nodes in a row, each real node should see k real neighbours; one that sees fewer had padding picked and then hidden
(En-transformer b98429c: padded nodes at the origin ranked as nearest, masked after the topk). A row of fewer real
nodes than k needs only as many. Quiet on the fix (padding ranked last), and where every reading has no such node.

A module that also holds a finite radius (`valid_radius`, a `cutoff`: equiformer-pytorch's) hides the neighbours
beyond it, the last slots of the ascending ranking its topk returns: only a node that sees a slot after one it is
hidden from had a nearer neighbour hidden by something else (equiformer-pytorch 5dfc465: padding ranked first).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.held import readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def short(run: Run) -> list:
    """Calls over k neighbour slots where a real node of a row of k real nodes or more sees fewer than k."""
    found = []
    for top in run.tops:
        said = next((one for one in top.stated if "neighbours" in one.fields), None)
        if said is None:
            continue
        k, scope = said.fields["neighbours"], said.fields.get("neighbours_scope") or ""
        done = set()
        for call in [c for c in (*run.calls, *run.cross) if top.first <= c.index < top.end]:
            # (more queries than keys: engine.py sets such calls apart with cross-attention, no query among the keys)
            rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
            key = (call.mask, call.shape)
            if k_len != k or q_len <= k or call.stored is None or key in done \
                    or scope and not (call.where or "").startswith(scope):
                continue
            done.add(key)
            cells = keep(call)
            helds = [h for h in call.details.get("held_padding") or () if h["kind"] in ("keep", "pad", "lengths")]
            if cells is None or cells.shape[0] not in (1, rows) or not helds:
                continue
            slots = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
            seen = slots.sum(axis=2)  # slots each node sees
            if said.fields.get("neighbours_radius"):  # a hidden slot before a seen one: no radius hid it
                later = np.flip(np.cumsum(np.flip(slots, axis=2), axis=2), axis=2) > slots
                seen = np.where((~slots & later).any(axis=2), seen, k)
            first, quiet = None, False
            for held in helds:
                tables = readings(held, rows, q_len)
                if not tables:
                    continue
                bad = [real & (seen < np.minimum(k, real.sum(axis=1))[:, None]) for real in tables]
                if not all(b.any() for b in bad):
                    quiet = True
                    break
                first = first or (held, bad[0])
            if first is None or quiet:
                continue
            held, bad = first
            b, q = (int(i) for i in np.argwhere(bad)[0])
            said_held = f"{held['name']} in {held['where']}"
            found.append((call, Finding("neighbours-padded", (
                f"batch row {b}: node {q} sees {int(seen[b, q])} of its {k} neighbour slots, though {said_held} calls "
                f"{int(readings(held, rows, q_len)[0][b].sum())} of the row's nodes real and {said.source} picks {k}"
                f"{radius_said(said, call, b, q)}: "
                f"padding was ranked among its nearest neighbours and hidden after ({int(bad.sum())} such nodes)"),
                expected=f"each real node sees min({k}, real nodes) neighbours", source=said.source, cell=(b, q, 0))))
    return found


def radius_said(said, call, b: int, q: int) -> str:
    """What a stated radius leaves open: it hides the farthest slots, not the nearer one this node lost."""
    radius = said.fields.get("neighbours_radius")
    if not radius:
        return ""
    slots = keep(call).any(axis=1)[min(b, keep(call).shape[0] - 1), q]
    return (f" (its {', '.join(radius)} hides only the farthest, the last of the ascending ranking, yet slot "
            f"{int(np.argmin(slots))} is hidden and slot {int(len(slots) - 1 - np.argmax(slots[::-1]))} seen)")


RULES = (
    Rule("neighbours-padded", "wrong", "call", "a k-nearest-neighbour attention (its module's own k) whose real node, "
         "in a row of at least k real nodes by the program's held padding, sees fewer than k neighbour slots", short),
)
