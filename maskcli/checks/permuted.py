"""Tokens reordered within each row before attention while the padding mask keeps their order from before (permuted.py).

A set or point-cloud encoder may sort its tokens (hepattn's Encoder: by `x_sort_value`, a gather of every row by its
own argsort). The model call was handed its padding as a (B, L) mask over the tokens in the order they came in (a
0/1 or bool argument of the call, each row a run of real tokens at one edge, one row whole); trace/permuted.py keeps
each reordering the call made, with the attention calls made before it. At each later self-attention call over those
B rows and L tokens, key k of row b is the token the reorderings put there (`perm[b, k]`, composed in order). Where
the keys some query sees are exactly that mask in the order before (either polarity) and not the mask reordered, the
mask was never gathered with the tokens: it hides real tokens and lets pads be seen (hepattn c85cf35: `kv_mask`
passed on as it came). Wrong: the program's own gather and its own mask say so. Quiet where the mask was reordered
by the same index (the fix), where the reordering moves no pad, and where no argument is such a mask.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.heldfold import padded_batch
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def permuted_padding(run: Run) -> list:
    """Each model call's first attention call whose key mask follows the tokens' order before the call reordered them."""
    found = []
    for top in run.tops:
        reorderings = [entry for entry in top.permuted if "rows" in entry]  # (not k tokens routed: checks/routed.py)
        if not reorderings:
            continue
        masks = _stated(reorderings[0]["masks"])
        for call in run.made_by(top) if masks else ():
            order = _order(top.permuted, call.index)
            if order is None or cross(call) or call.shape[0] != order.shape[0] or call.shape[2:] != (order.shape[1],) * 2:
                continue
            cells = keep(call)
            if cells is None:
                continue
            seen = np.broadcast_to(cells.any(axis=(1, 2)), (order.shape[0], order.shape[1]))
            hit = _contradicted(seen, masks, order)
            if hit is not None:
                found.append((call, _finding(hit, order)))
                break
    return found


def reordered(top, call, real: np.ndarray) -> np.ndarray:
    """`real` (B, L), the model call's padding in the order its tokens came in, in their order at `call` (each
    reordering made before it applied), for the rules that read the call's padding at its keys."""
    order = _order(top.permuted, call.index) if top is not None and top.permuted else None
    if order is None or order.shape != real.shape:
        return real
    return np.take_along_axis(real, order, axis=1)


def _stated(handed: dict) -> list[tuple[str, np.ndarray]]:
    """(name, real tokens) of each (B, L) 0/1 argument of the model call that reads as its padding, either polarity."""
    found = []
    for name, value in handed.items():
        for real in (value, ~value):
            if padded_batch(real, right_only=False):
                found.append((name, real))
    return found


def _order(permuted: tuple, index: int) -> np.ndarray | None:
    """The tokens' order at call `index`: each reordering made before it composed (x1 = x0[p1], x2 = x1[p2] =
    x0[p1[p2]]), one shape throughout; None where there is none or it is no reordering."""
    order = None
    for entry in permuted:
        if entry["after"] > index:
            break
        if "rows" not in entry:
            continue  # (k of the tokens routed, no reordering: trace/routed.py)
        rows = entry["rows"]
        if order is not None and order.shape != rows.shape:
            return None
        order = rows if order is None else np.take_along_axis(order, rows, axis=1)
    if order is None or (order == np.arange(order.shape[1])[None, :]).all():
        return None
    return order


def _contradicted(seen: np.ndarray, masks: list, order: np.ndarray):
    """(name, real, reordered, b, k) where the keys seen are a stated mask in the order before and not reordered."""
    for name, real in masks:
        if real.shape != seen.shape:
            continue
        reordered = np.take_along_axis(real, order, axis=1)
        if (seen == real).all() and not (seen == reordered).all():
            b, k = map(int, np.argwhere(seen != reordered)[0])
            return name, real, reordered, b, k
    return None


def _finding(hit: tuple, order: np.ndarray) -> Finding:
    name, real, reordered, b, k = hit
    token = int(order[b, k])
    said = "a real token" if reordered[b, k] else "padding"
    shown = "seen" if real[b, k] else "hidden"
    return Finding("padding-not-permuted", (
        f"batch row {b}: key {k} is {shown}, but the tokens were reordered within each row (a gather by a permutation) "
        f"before this call and key {k} is token {token}, which the model call's `{name}` calls {said}: the mask keeps "
        f"the tokens' order from before ({int((real != reordered).sum())} such keys) — gather `{name}` with the same "
        "index as the tokens"), expected=f"`{name}` reordered as the tokens were", source=f"the model call's `{name}`",
        cell=(b, 0, k))


RULES = (
    Rule("padding-not-permuted", "wrong", "steps", "tokens reordered within each row (sorted by a gather) before "
         "attention while the padding mask the model call was handed keeps their order from before", permuted_padding),
)
