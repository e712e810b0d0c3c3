"""NaN that spreads: an earlier softmax's rows that see no key are NaN, and a later call's real queries score NaN.

A softmax over a row that is -inf everywhere is NaN (rows.py says so of the call itself, *suspicious*: the program may
zero those rows or never read them). What the program does with them is seen at the calls that follow: where a later
softmax's scores hold NaN in a query row that an earlier call of the run let see keys (a real query there), the NaN of
the rows that saw nothing was handed on as keys or values (a bias of -inf over padded nodes' whole rows, DGL's
Graphormer, dgl#5476: the padded nodes' outputs are NaN, the next layer's real nodes score NaN against them and their
softmax is NaN everywhere). That is no longer a condition maskcli cannot see: the run's own scores are NaN there, so
it is *wrong*. The NaN may come in through the values alone (vit-pytorch#26: the next layer fills the padded keys'
NaN scores with -inf, so its real rows' weights are finite and 0 there, and 0 x NaN is NaN): the product of a real
row's finite weights with the values is NaN (trace/after.py's `nan_values`), wrong too.

Stays quiet where no earlier call made NaN rows (NaN of the program's data is not the mask's), where the earlier rows
were zeroed after their softmax (trace/after.py), and where only the rows that saw nothing before score NaN again.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _nan_sources(calls: list) -> list:
    """Softmax calls whose rows that see no key are -inf everywhere (NaN out) and are not zeroed after."""
    return [call for call in calls if call.api == "softmax" and call.details.get("fill") == "-inf"
            and call.details.get("nan_rows") and not call.details.get("zeroed_after")]


def _seen_rows(call, rows: int, q_len: int) -> np.ndarray | None:
    """Bool (rows, Lq): the queries of each batch row that see at least one key at `call` (over its heads)."""
    cells = keep(call)
    if cells is None or call.shape[2] != q_len or cells.shape[0] not in (1, rows):
        return None
    return np.broadcast_to(cells.any(axis=(1, 3)), (rows, q_len))


def nan_rows(call, facts: tuple = ("nan_scores",)) -> np.ndarray:
    """bool (B, Lq): the query rows whose scores (or values: "nan_values") hold a NaN in some head (trace's facts, flat
    over B, H, Lq)."""
    b_len, h_len, q_len = call.shape[0], call.shape[1], call.shape[2]
    flat = np.asarray([i for fact in facts for i in call.details.get(fact) or ()], dtype=np.int64)
    nan = np.zeros(b_len * h_len * q_len, dtype=bool)
    nan[flat[flat < nan.size]] = True
    return nan.reshape(b_len, h_len, q_len).any(axis=1)


def nan_spread(run: Run) -> list:
    """Later softmax calls whose scores are NaN in query rows an earlier call's mask let see keys, after an earlier
    call made NaN rows (every key -inf)."""
    calls = sorted([*run.calls, *run.unmasked], key=lambda call: call.index)
    sources = _nan_sources(calls)
    found = []
    if not sources:
        return found
    for call in calls:
        if not (call.details.get("nan_scores") or call.details.get("nan_values")) or call.api != "softmax":
            continue
        b_len, q_len = call.shape[0], call.shape[2]
        nan = nan_rows(call, ("nan_scores", "nan_values"))  # (B, Lq): rows with a NaN score in any head
        for source in sources:
            if source.index >= call.index or source.shape[0] != b_len:
                continue
            seen = _seen_rows(source, b_len, q_len)
            if seen is None:
                continue
            hit = nan & seen
            if not hit.any():
                continue
            b = int(np.argwhere(hit.any(axis=1))[0][0])
            rows = [int(q) for q in np.flatnonzero(hit[b])]
            empty = [int(q) for q in np.flatnonzero(~seen[b])]
            found.append((call, Finding("nan-spread", (
                f"the {'scores' if not call.details.get('nan_values') else 'scores or the output'} of query rows "
                f"{spans(rows)} of batch row {b} are NaN here, though these queries saw keys "
                f"at {source.where} (call {source.index}); there rows {spans(empty) or 'of other batch rows'} saw no "
                f"key at all and their softmax of all -inf gave NaN, which this call reads as keys or values: the "
                f"NaN of rows the mask empties spreads to real queries (mask the padded keys, not whole rows, or zero "
                f"those rows)"),
                expected="no NaN in the scores of a query that sees keys", source=f"the NaN rows of {source.where}",
                cell=(b, rows[0], 0))))
            break
    return found


def nan_backward(run: Run) -> list:
    """A softmax whose rows that see no key are NaN, multiplied by values autograd records, that the run's backward
    pass went through (trace/after.py's `nan_backward`)."""
    found, done = [], set()
    for call in sorted([*run.calls, *run.unmasked, *run.cross], key=lambda call: call.index):  # (a cross-attention's
        # emptied rows too: ISAB's induced points over a set that is all padding, isab-pytorch 9968cf7)
        rows = call.details.get("nan_backward")
        if not rows or call.api != "softmax" or call.details.get("zeroed_after") or (call.mask, call.shape) in done:
            continue
        done.add((call.mask, call.shape))
        cells = keep(call)
        empty = None if cells is None else ~cells.any(axis=(1, 3))  # (B, Lq): rows that see no key in any head
        b = 0 if empty is None or not empty.any() else int(np.flatnonzero(empty.any(axis=1))[0])
        which = "" if empty is None or not empty.any() else \
            f" (query rows {spans(np.flatnonzero(empty[b]).tolist())} of batch row {b} see no key)"
        found.append((call, Finding("nan-rows-backward", (
            f"{rows} query rows of this softmax (over its batch rows and heads) see no key at all and are NaN (softmax of "
            f"all -inf){which}; the run's "
            f"backward pass went through their product with the values, whose gradient is weightsᵀ @ grad: NaN x 0 "
            f"is NaN, so the values and every parameter before them get NaN gradients, whether or not those rows' "
            f"outputs are used (zero the weights of the rows that see nothing after the softmax, or mask the keys "
            f"only)"),
            expected="no NaN weights in a product the backward pass goes through",
            source="the run's own backward pass", cell=(b, 0, 0))))
    return found


RULES = (
    Rule("nan-spread", "wrong", "steps", "a later softmax whose real queries score NaN after an earlier call's rows "
         "that see no key (every key -inf) gave NaN: the NaN of emptied rows handed on as keys or values (dgl#5476)",
         nan_spread),
    Rule("nan-rows-backward", "wrong", "steps", "a softmax's rows that see no key (every key -inf, NaN) multiplied by "
         "values the run's backward pass goes through: NaN gradients for the whole model (dgl#2657)", nan_backward),
)
