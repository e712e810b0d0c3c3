"""Keys a softmax's mask hides, given weight again after the softmax, before the weights reach the values.

The program masks a key by filling its score before the softmax: its weight is then 0. What it computes of the weights
afterwards is followed (trace/weights.py), and two things give those keys weight again:

- a second softmax over the weights (DisKT#2: `p_attn = F.softmax(p_attn, dim=-1)` after the masked softmax and the
  counter-attention zeroing): every masked key's weight 0 becomes exp(0) = 1, as heavy as any key the first one kept
  (at most e), so each query attends the keys its mask hid. The call records `over_weights` (the first softmax);
  *wrong* where a key the first softmax hid, on a row it leaves some key, is kept by the second;
- a tensor added to the weights (molecule-attention-transformer 23c9cbe: `attn + Lg * adjacency_mat`, the adjacency
  of padded atoms unmasked): where the weights the values are multiplied by give a masked key at least a thousandth
  of the row's largest weight (`weighted_after`). *wrong* where that key is padding (no query of its batch row sees
  it: the program states it is no token) or a later key of a row its mask keeps causal (no row of a causal mask may
  read ahead); otherwise *suspicious*: a term added on purpose over keys the attention itself does not read (a prior
  over a graph's other nodes) looks the same.

Quiet: a product or a 0/1 mask multiplied in (it keeps a masked key at 0), a scalar or an epsilon added (less than a
thousandth of the row), a row the softmax hides whole (no key of it was meant), and a second softmax over weights
whose first masked nothing.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _by_index(run: Run) -> dict:
    return {call.index: call for call in [*run.calls, *run.cross, *run.unmasked, *run.reweighed]}


def _cells(call) -> np.ndarray | None:
    cells = keep(call)
    return None if cells is None or cells.ndim != 4 else np.asarray(cells, dtype=bool)


def resoftmaxed(run: Run) -> list:
    """(call, Finding) for each softmax over an earlier softmax's weights that keeps keys that one hid."""
    found, done, calls = [], {}, None
    for call in [*run.calls, *run.cross, *run.unmasked, *run.reweighed]:
        first = call.details.get("over_weights")
        if first is None or call.stored is None:
            continue
        calls = calls if calls is not None else _by_index(run)
        origin, rows = calls.get(first), call.details.get("over_rows") or (0, None)
        key = (call.mask, None if origin is None else origin.mask, tuple(rows))
        if key not in done:
            done[key] = None
            before, after = (None, None) if origin is None else (_cells(origin), _cells(call))
            if before is not None:  # (the first one's query rows this one runs over: sparseKT's rows past k_index)
                before = before[:, :, rows[0]:rows[1]]
            if before is not None and after is not None and before.shape[2:] == after.shape[2:]:
                shape = np.broadcast_shapes(before.shape, after.shape)
                before, after = np.broadcast_to(before, shape), np.broadcast_to(after, shape)
                bad = ~before & before.any(axis=-1, keepdims=True) & after
                if bad.any():
                    b, _, q, k = (int(x) for x in np.argwhere(bad)[0])
                    q += rows[0]
                    done[key] = Finding("unmasked-after-softmax", (
                        f"this softmax runs over the weights of an earlier softmax ({origin.where}), whose mask hides "
                        f"key {k} from query {q} (batch row {b}): its weight there is 0, and exp(0) here, as heavy as "
                        f"any key that one kept, so the query attends the keys its mask hid ({int(bad.sum())} such "
                        "cells); renormalise the weights by their row's sum instead of a second softmax"),
                        expected="the keys the first softmax's mask hides at weight 0",
                        source="the mask of the softmax whose weights these are", cell=(b, q, k))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def added_after(run: Run) -> list:
    """(call, Finding) for each softmax whose weights, something added to them, give a key its mask hides weight."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked, *run.reweighed]:
        said = call.details.get("weighted_after")
        if not isinstance(said, dict) or call.where in done:
            continue
        done.add(call.where)
        b, h, q, k = said["cell"]
        why = ("a padding key (no query of its batch row sees it)" if said.get("padding") else
               "a later key of a row its mask keeps causal" if said.get("later") else None)
        found.append((call, Finding("unmasked-after-softmax", (
            f"something added to this softmax's weights after it (weights + a term, before the product with the "
            f"values) gives key {k} weight on query {q} (batch row {b}, head {h}), which the softmax's own mask hides"
            + (f": {why}" if why else "") + f" ({said['cells']} such cells on {said['rows']} rows); mask the added "
            "term as the scores are masked" + ("" if why else (
                ", unless the added term is meant to reach keys the attention does not (a prior over every key)"))),
            severity=None if why else "suspicious", expected="the keys the softmax's mask hides at weight 0",
            source="the softmax's own mask (its filled scores)", cell=(b, q, k))))
    return found


def weighted(run: Run) -> list:
    return resoftmaxed(run) + added_after(run)


RULES = (
    Rule("unmasked-after-softmax", "wrong", "call", "keys a softmax's mask hides given weight again before the weights "
         "reach the values: a second softmax over the weights (DisKT#2), or an unmasked term added to them (a padded "
         "atom's adjacency: molecule-attention-transformer 23c9cbe)", weighted),
)
