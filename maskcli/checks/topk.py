"""A sparse top-k attention whose mask does not keep the top k keys it ranked: turned round, or ranked before a mask.

The program states the mask itself: it ranks each query's scores along their keys with `topk(k)` (trace/ranked.py:
details["topk"], k and the keys each row had open when ranked) and keeps the k best of each row. A query row of the
softmax that ran then keeps
- more than k keys: the top-k mask was used the wrong way round, True on the keys below the k-th score taken as the
  keep-mask, so the k best keys are the ones dropped (lucidrains/x-transformers d1f5d6b: `sim < top_values[..., -1:]`);
- fewer than the k it ranked (fewer than k only where the row had fewer open): a mask applied after the ranking hid
  keys the top-k chose, so the k slots went to keys the row never sees: the top-k taken before the causal or padding
  mask (the same commit: future keys took part in the top-k).
A row keeps exactly min(k, its open keys) where the top-k is kept after every other mask (the fix: `sim >= kth &
sim > mask_value`): quiet. Counts per batch row, head and query, with no position assumed: a cache's offset moves
no count. Ties at the k-th score keep more than k only on equal float scores, which a trained model does not make.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def ranked(run: Run) -> list:
    found, done = [], {}
    for call in run.calls:
        fact = call.details.get("topk")
        if not fact:
            continue
        key = (call.mask, call.shape, fact["k"], tuple(fact.get("open", ())))
        if key not in done:
            done[key] = _finding(call, fact)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, fact: dict) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    rows, heads, q_len, k_len = call.shape
    try:
        kept = np.broadcast_to(cells, (rows, heads, q_len, k_len)).sum(axis=-1)  # (B, H, Lq)
    except ValueError:
        return None
    k = int(fact["k"])
    ranked_at = dict(expected=f"each query keeps the top {k} keys its scores ranked (fewer only where fewer were open)",
                     source=f"the program's own topk({k}) over the scores, along the keys")
    if (kept > k).any():
        b, h, q = (int(x) for x in np.argwhere(kept > k)[0])
        return Finding("topk-mask-not-topk", (
            f"batch row {b}, head {h}: query {q} keeps {int(kept[b, h, q])} of {k_len} keys where the program ranked "
            f"its scores' top {k} ({int((kept > k).sum())} such query rows): the top-k mask used the wrong way round "
            f"(True on the keys below the k-th score, taken as the keep-mask: the {k} best keys dropped?)"),
            **ranked_at)
    opened = fact.get("open")
    if opened is None or len(opened) != rows * heads * q_len:
        return None
    short = kept < np.asarray(opened).reshape(rows, heads, q_len)
    if not short.any():
        return None
    b, h, q = (int(x) for x in np.argwhere(short)[0])
    chose = int(np.asarray(opened).reshape(rows, heads, q_len)[b, h, q])
    return Finding("topk-mask-not-topk", (
        f"batch row {b}, head {h}: query {q} keeps {int(kept[b, h, q])} keys where the program's topk({k}) chose {chose} "
        f"among the keys open when it ranked ({int(short.sum())} such query rows): a mask applied after the top-k hid keys it chose (the top-k taken "
        f"before the causal or padding mask, so keys the query never sees took its top-k slots)"),
        **ranked_at)


RULES = (
    Rule("topk-mask-not-topk", "wrong", "call", "a sparse top-k attention whose softmax keeps more than the k keys it "
         "ranked (the top-k mask turned round) or fewer (the top-k taken before a mask that hides keys it chose)",
         ranked),
)
