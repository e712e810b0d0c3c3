"""A sparse top-k attention whose mask does not keep the top k keys it ranked: turned round, or ranked before a mask.

The program states the mask itself: it ranks each query's scores along their keys with `topk(k)` (trace/ranked.py:
details["topk"], k and the keys each row picked among those open when ranked) and keeps the k best of each row. The
softmax that ran is read against those picks, per batch row, head and query (no position assumed: a cache's offset
moves no pick):
- every key it keeps is one the top-k picked (the top-k is its mask), yet a row keeps fewer than it picked: a mask
  applied after the ranking hid keys the top-k chose, so their slots went to keys the query never sees (the top-k
  taken before the causal or padding mask: lucidrains/x-transformers d1f5d6b, future keys in the top-k);
- no key it keeps is one the top-k picked, and it keeps some: the top-k mask used the wrong way round, True on the
  keys below the k-th score taken as the keep-mask, so the k best keys are the ones dropped (the same commit:
  `sim < top_values[..., -1:]`).
A topk of the smallest scores (largest=False) picks the keys the mask drops: read as keeping the others, turned round
where it keeps only those; a later mask that drops more (TimeFilter's MoE region mask after its KNN) is no slot lost.
A softmax that keeps keys both picked and not is no top-k mask (a topk taken for another use, ties at the k-th
score): quiet, and so is a row that keeps every key it picked (the fix: `sim >= kth & sim > mask_value`).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def picks(call) -> tuple | None:
    """(kept, picked): bool (B, H, Lq, Lk) of the keys the call's softmax keeps and of those its topk picked (open
    when ranked; for a topk of the smallest, the keys it did not pick); None where the call states no top-k or its mask
    is not read."""
    fact = call.details.get("topk")
    cells = keep(call) if fact else None
    if cells is None:
        return None
    rows, heads, q_len, k_len = call.shape
    k = int(fact["k"])
    chosen = np.asarray(fact["picked"], dtype=np.int64)
    if chosen.size != rows * heads * q_len * k:
        return None
    try:
        cells = np.broadcast_to(cells, (rows, heads, q_len, k_len))
    except ValueError:
        return None
    chosen = chosen.reshape(rows, heads, q_len, k)
    picked = np.zeros(cells.shape, dtype=bool)
    b, h, q, j = np.nonzero(chosen >= 0)
    picked[b, h, q, chosen[b, h, q, j]] = True
    if fact.get("smallest"):  # (a topk of the smallest picks the keys the mask drops: it keeps the others)
        picked = ~picked
    return cells, picked


def reading(call) -> str | None:
    """"kept" where every key the softmax keeps is one its topk picked, "turned" where it keeps none of them (and some
    key), None where no top-k is its mask."""
    held = picks(call)
    if held is None:
        return None
    cells, picked = held
    if not (cells & ~picked).any():
        return "kept"
    return "turned" if not (cells & picked).any() and cells.any() else None


def ranked(run: Run) -> list:
    found, done = [], {}
    for call in run.calls:
        if "topk" not in call.details:
            continue
        key = (call.mask, call.shape, id(call.details["topk"]))
        if key not in done:
            done[key] = _finding(call)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call) -> Finding | None:
    how = reading(call)
    if how is None:
        return None
    cells, picked = picks(call)
    k, k_len = int(call.details["topk"]["k"]), call.shape[3]
    kept, chose = cells.sum(axis=-1), picked.sum(axis=-1)  # (B, H, Lq)
    smallest = bool(call.details["topk"].get("smallest"))
    ranking, picking = (f"topk({k}, largest=False)", "left") if smallest else (f"topk({k})", "picked")
    keeps = "only keys its scores' top-k left" if smallest else f"the {k} keys its scores' top-k picked"
    stated = dict(expected=f"each query keeps {keeps} (fewer only where fewer were open)",
                  source=f"the program's own {ranking} over the scores, along the keys")
    if how == "turned":
        b, h, q = (int(x) for x in np.argwhere(kept > 0)[0])
        return Finding("topk-mask-not-topk", (
            f"batch row {b}, head {h}: query {q} keeps {int(kept[b, h, q])} of {k_len} keys, none of the "
            f"{int(chose[b, h, q])} its scores' {ranking} {picking}, and no query keeps one ({int((kept > 0).sum())} "
            f"query rows): the top-k mask used the wrong way round (True on the keys "
            f"{'the ranking dropped' if smallest else 'below the k-th score'}, taken as the keep-mask: the best keys "
            f"dropped)"),
            **stated)
    short = kept < chose
    if not short.any() or smallest:  # (the keys dropped by a topk of the smallest: a
        # later mask may drop more, none it picked takes a slot)
        return None
    b, h, q = (int(x) for x in np.argwhere(short)[0])
    return Finding("topk-mask-not-topk", (
        f"batch row {b}, head {h}: query {q} keeps {int(kept[b, h, q])} keys, where the program's topk({k}) "
        f"picked {int(chose[b, h, q])} among the keys open when it ranked ({int(short.sum())} such query rows): a "
        f"mask applied after the top-k hid keys it chose (the top-k taken before the causal or padding mask, so keys "
        f"the query never sees took its top-k slots)"), **stated)


RULES = (
    Rule("topk-mask-not-topk", "wrong", "call", "a sparse top-k attention whose softmax keeps none of the keys its topk "
         "picked (the top-k mask turned round), or fewer than it picked (the top-k taken before a mask that hides them)",
         ranked),
)
