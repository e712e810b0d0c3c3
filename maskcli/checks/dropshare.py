"""A sequence dropout that keeps the same number of key slots in every batch row, padding counted among them.

A structured sequence dropout (Perceiver AR, perceiver-pytorch's `dropout_seq`) keeps `int((1 - p) * n)` of the n
positions of each row as the keys of a cross-attention, ranked by random scores with the padding ranked last, and
gathers the padding mask along with them. Counted over n, a short row's slots reach past its real tokens: it keeps
every one of them and the rest of its slots fall on padding, masked, while a full row keeps its share
(lucidrains/perceiver-pytorch c8c5f57: the fix ANDs the gathered mask with `arange(num_keep) < ceil(len * (1 - p))`).

Read per call (self- or cross-attention), per batch row, with the padding the model call states (checks/real.stated):
- the model states a dropout rate p (trace/seqdrop.py: a float under a name with "drop" in it, on a module in training
  mode or in a config it keeps: dropout drops nothing in eval);
- the call has fewer keys than the model call's n positions, and exactly the share of them that p keeps
  (`int`, `round` or `ceil` of (1 - p) * n, at least 1): its keys are the kept slots;
- some batch row keeps its own share of its real tokens (floor to ceil of (1 - p) * len): the rate is applied;
- another batch row, padded, keeps more real keys than the ceil of its share, and no more than its real tokens: wrong,
  the slots were counted over padding.
Quiet where each row keeps its share of its own tokens (the fix), where no row is padded (every row keeps the slots'
share of n), where the keys are not the stated share of n (an attention dropout's rate, a memory of its own size) and
where a row sees more keys than its real tokens (a Linformer's keys projected to the share's count: no dropout of them).
"""

from __future__ import annotations

import math

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row, stated_once
from maskcli.checks.registry import Rule
from maskcli.text import Finding

EPS = 1e-9


def _slots(keep_share: float, n: int) -> set[int]:
    """The slot counts a dropout keeping `keep_share` of n positions may keep: int, round and ceil, at least 1."""
    x = keep_share * n
    return {max(1, v) for v in (int(x), int(math.floor(x + EPS)), round(x), int(math.ceil(x - EPS)))}


def _share(keep_share: float, length: int) -> tuple[int, int]:
    """(fewest, most) real tokens a row of `length` keeps under `keep_share`: floor to ceil of the product, at least 1
    where it has any."""
    x = keep_share * length
    low, high = int(math.floor(x + EPS)), int(math.ceil(x - EPS))
    return (max(1, low), max(1, high)) if length else (0, 0)


def _rates(top) -> list:
    return [one for one in top.stated if "drop_rate" in one.fields and one.fields.get("drop_training")]


def _lengths(top, rows: int, k_len: int) -> list[int]:
    """The widths of the model call's 2-D arguments over `rows` batch rows longer than the call's keys."""
    widths = {int(v.shape[1]) for v in top.arguments.values()
              if isinstance(v, np.ndarray) and v.ndim == 2 and v.shape[0] == rows and v.shape[1] > k_len}
    return sorted(widths)


def kept_rows(seen: np.ndarray, real: np.ndarray, keep_share: float) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(batch rows that keep their share of their real tokens, [(batch row, keys kept, its most share)] of the rows that
    keep more than the ceil of their share), `seen` bool (B, Lk) the keys some query of each row sees, `real` bool (B, n)
    the real tokens the model call states."""
    fair, over = [], []
    for b in range(seen.shape[0]):
        length, kept = int(real[b].sum()), int(seen[b].sum())
        low, high = _share(keep_share, length)
        if low <= kept <= high:
            fair.append(b)
        elif high < kept <= length < real.shape[1]:  # (a padded row's own tokens: keys that are no dropout of its
            # tokens, more than it has, are another design's: a Linformer's projected keys)
            over.append((b, kept, high))
    return fair, over


def dropout_share(run: Run) -> list:
    found, done, memo = [], set(), {}
    for call in [*run.calls, *run.cross]:
        top = run.top(call)
        if top is None or call.mask in done or call.stored is None:
            continue
        rates = _rates(top)
        rows, _, q_len, k_len = call.shape
        if not rates or k_len < 2:
            continue
        for n in _lengths(top, rows, k_len):
            rate = next((one for one in rates if k_len in _slots(1.0 - one.fields["drop_rate"], n)), None)
            if rate is None:
                continue
            real = stated_once(memo, top, rows, n)
            cells = keep(call)
            if real is None or cells is None:
                continue
            share = 1.0 - rate.fields["drop_rate"]
            per_row = by_row(cells, rows)  # (B, Lq, Lk)
            fair, over = kept_rows(per_row.any(axis=1), real[0], share)
            if not fair or not over:
                continue
            done.add(call.mask)
            b, kept, high = over[0]
            length = int(real[0][b].sum())
            k = int(np.flatnonzero(per_row[b].any(axis=0))[high])
            q = int(np.flatnonzero(per_row[b, :, k])[0])
            others = f" ({len(over)} such batch rows)" if len(over) > 1 else ""
            found.append((call, Finding("dropout-keeps-padding-share", (
                f"batch row {b} keeps {kept} of its {length} real tokens as keys, where {rate.source} keeps at most "
                f"{high} of them (ceil({length} x {share:g})); the call's {k_len} keys are the {share:g} share of the "
                f"model call's {n} positions, the same slots in every row, padding counted: batch row {fair[0]} keeps "
                f"its share, a padded row keeps {'every' if kept == length else 'more of its'} real token"
                f"{'' if kept == length else 's'} and its other slots fall on padding{others}"),
                expected=f"batch row {b}: at most {high} real keys kept ({share:g} of its {length})",
                source=f"{rate.source}, the real tokens stated by {real[1]}",
                cell=(b, q, k))))
            break
    return found


RULES = (
    Rule("dropout-keeps-padding-share", "wrong", "steps", "a sequence dropout that keeps the same key slots in every "
         "row, counted over padding: a short row keeps all its real tokens instead of the stated rate's share",
         dropout_share),
)
