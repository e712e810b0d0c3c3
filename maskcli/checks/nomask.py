"""A model that attends one way when handed no attention_mask and another when handed one that masks nothing.

An `attention_mask` of all ones (no padding: every token real) states what leaving it out states: the model's
attention over the same tokens is the same either way. Where one call site, over the same input ids, is causal at the
model call handed an all-ones (batch, tokens) attention_mask and lets queries see later keys at the model call handed
none, or the other way round, the branch that built one of them dropped the causal mask (transformers#30123: Falcon's
SDPA path with ALiBi used the bare bias as attn_mask when no mask was given). The call that sees later keys is said.
Quiet where the two model calls differ in anything else they were handed (a flag, a prefix, other ids), where the mask
handed is not (batch, tokens) or masks a token, on cross-attention, and on calls of a cache (queries fewer than keys).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, equals, first_cell, keep, triu
from maskcli.checks.registry import Rule
from maskcli.text import Finding

NAME = "attention_mask"
HANDED = {"none": "no attention_mask", "ones": "an attention_mask of all ones"}  # what each state says in a finding


def _stated(top, rows: int, length: int) -> str | None:
    """"none" where the model call was handed no attention_mask, "ones" where one of (rows, length) that masks nothing;
    None otherwise."""
    mask = top.arguments.get(NAME)
    if mask is None:
        return "none"
    if isinstance(mask, np.ndarray) and mask.shape == (rows, length) and mask.dtype != np.float64 and (mask == 1).all():
        return "ones"
    return None


def _same_else(a, b) -> bool:
    """The two model calls were handed the same arguments besides the attention_mask (their ids equal)."""
    one = {k: v for k, v in a.arguments.items() if k not in (NAME, "output_rows")}  # (what each call returned: apart)
    two = {k: v for k, v in b.arguments.items() if k not in (NAME, "output_rows")}
    if one.keys() != two.keys() or not any(isinstance(v, np.ndarray) for v in one.values()):
        return False
    return all(_equal(v, two[k]) for k, v in one.items())


def _equal(one, two) -> bool:
    """Equal arguments, arrays by their cells, (name, array) pairs (first_ids, handed_cells) item by item."""
    if isinstance(one, np.ndarray) or isinstance(two, np.ndarray):
        return isinstance(one, np.ndarray) and isinstance(two, np.ndarray) and np.array_equal(one, two)
    if isinstance(one, tuple) and isinstance(two, tuple):
        return len(one) == len(two) and all(_equal(a, b) for a, b in zip(one, two))
    return bool(one == two)


def none_differs(run: Run) -> list:
    """Calls that see later keys where the same site over the same ids is causal with the other of None / all ones."""
    found = []
    for (where, _), calls in run.callers().items():
        read = []
        for call in calls:
            top = None if cross(call) or call.shape[2] < 2 or call.shape[2] != call.shape[3] else run.top(call)
            state = None if top is None else _stated(top, call.shape[0], call.shape[3])
            cells = None if state is None else keep(call)
            if cells is not None and cells.any(axis=-1).all():
                read.append((call, top, state, cells))
        causal = [one for one in read if equals(one[3], "causal")]
        for call, top, state, cells in read:
            later = triu(cells, k=1)
            if not later.any():
                continue
            other = next((one for one in causal if one[2] != state and one[0].shape == call.shape and _same_else(one[1], top)),
                         None)
            if other is None:
                continue
            b, h, q, k = first_cell(later)
            found.append((call, Finding("mask-none-differs", (
                f"handed {HANDED[state]}, query {q} of batch row {b} sees later key {k}, "
                f"while the same call site over the same ids is causal at step {other[0].step}, handed "
                f"{HANDED[other[2]]}: neither masks a token, so the two should attend alike (the causal mask dropped on "
                f"the branch for {HANDED[state]}?)"), expected="causal", source=f"{where} at step {other[0].step}",
                cell=(b, q, k))))
            break
    return found


RULES = (
    Rule("mask-none-differs", "wrong", "site", "a call site that sees later keys over the same ids where it is causal "
         "with the other of no attention_mask / an all-ones one (transformers#30123: the causal mask dropped on the "
         "no-mask branch)", none_differs),
)
