"""A key mask cancelled by a softmax over the queries: the padded keys keep their weight.

A softmax over dim -2 of q @ kᵀ scores whose finite fill hides the same keys in every query row (trace/overqueries.py:
an additive -1e9 key padding bias, or masked_fill over (B, 1, Lk)), its weights read as they are by a product that sums
their key axis (weights @ values, an einsum): the program's mask says those keys are padding, and its product says each
query pools the keys with these weights; but the fill is one constant per key column, the axis the softmax normalises,
so it cancels, and every padded key's column sums to one over the queries (pyg-team/pytorch_geometric#6343: the old
GraphMultisetTransformer's `torch.softmax(mask + attention_score, 1)`, over the seeds; each seed attended the
zero-padded nodes of the smaller graphs). Wrong where a padded cell still has weight after whatever 0/1 mask the
program multiplied into the weights (trace/after.py narrows the call: Slot Attention zeroes its padded inputs after
its softmax over the slots, then renormalises). Quiet where nothing sums the weights' keys with them (LoFTR's dual
softmax multiplies two softmaxes), on a fill of -inf, and on a fill that varies along the queries.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def cancelled(run: Run) -> list:
    """Each call of a softmax over the queries whose fill hid key columns that still keep weight in the product."""
    found, done = [], {}
    for call in [*run.calls, *run.cross, *run.unmasked]:
        over = call.details.get("over_queries")
        if not isinstance(over, dict) or not over.get("summed") or not over.get("runs"):
            continue
        key = (call.mask, call.shape, id(over))
        if key not in done:
            done[key] = _finding(call, over)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, over: dict) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    b, h, q_len, k_len = call.shape
    cells = np.broadcast_to(cells, (b, h, q_len, k_len)).reshape(b * h, q_len, k_len)
    for row, start, end in over["runs"]:
        if row >= b * h:
            continue
        seen = cells[row, :, start:end]
        if not seen.any():
            continue  # (a 0/1 mask after the softmax hid this run: the program masked it there)
        q, k = (int(n) for n in np.argwhere(seen)[0])
        k += start
        where = f"scores row {row}" if over["rank"] == 3 else f"batch row {row // h}, head {row % h}"
        keys = f"key {start}" if end - start == 1 else f"keys {start}-{end - 1}"
        return Finding("mask-cancelled-over-queries", (
            f"{where}: the mask fills {keys} with {over['fill']:g} in every one of the {q_len} query rows, but the "
            f"softmax runs over the queries (dim {over['dim']}), the axis that fill is constant along, so it cancels: "
            f"query {q} still takes weight from padding key {k} (each masked key's weights sum to one over the queries; "
            f"{over['keys']} padded keys in {over['rows']} rows), and {over['summed']} sums them into its output "
            f"(a softmax over the keys, dim -1, was meant)"),
            expected="a softmax over the keys (dim -1), where the key mask hides the padding",
            source=f"softmax over dim {over['dim']}", cell=(row if over["rank"] == 3 else row // h, q, k))
    return None


RULES = (
    Rule("mask-cancelled-over-queries", "wrong", "call", "a softmax over the query axis (dim -2) of scores whose finite "
         "fill masks the same keys in every query row, its weights summed over the keys by the values' product: the "
         "fill cancels and every query attends the padding keys (pyg-team/pytorch_geometric#6343, GMT's "
         "softmax(mask + score, 1))", cancelled),
)
