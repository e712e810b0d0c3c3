"""A relative-position bias that tells one side's distances apart only, on a mask that lets queries see the other side.

T5's unidirectional buckets (`bidirectional=False`; lucidrains' `n = max(-(k - q), 0)`) give every key after a query the
value of the query's own key: the bias cannot tell one later key from another, so the program states that its queries
never look ahead. trace/posbias.py reads the bias a softmax adds per distance k - q on the cells its mask keeps, each
query row less its value at its own column. Where a full pass (as many queries as keys, query i at key i) adds a bias
that is one function of k - q, flat at its distance-0 value over every later distance it sees (two or more, each in two
cells or more) on every head, while it varies over the earlier ones, and every real query with a real key after it in
its batch row sees one, the mask contradicts the bias (lucidrains/audiolm-pytorch 9cd86d2: the bucketed bias added and
no causal mask). Mirrored: a bias flat over the earlier distances states queries that never look back. Quiet: the
later keys masked (nothing seen there), a bidirectional bias (T5's encoder buckets: distance 1 has a bucket of its
own; ALiBi's slope * (k - q) varies both ways), a prefix-LM whose last queries see no later key (T5X's decoder-only
prefix LM keeps bidirectional=False), a bias of 0 everywhere (a mask added), a bias that differs across rows at one
distance (XLNet's content term).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

TOLERANCE = 1e-3  # of the bias's largest value: float32 sums, a float16 cast's rounding


def _sides(found: dict) -> int:
    """+1 where the bias is flat over the later distances and varies over the earlier, -1 mirrored, 0 otherwise."""
    if "low" not in found:
        return 0
    low = np.array(found["low"], dtype=np.float64)  # (heads, distances; None read as NaN)
    high = np.array(found["high"], dtype=np.float64)
    count = np.array(found.get("count", 0))
    if low.shape != high.shape or low.ndim != 2 or count.shape != low.shape:
        return 0
    seen = np.isfinite(low) & np.isfinite(high) & (count >= 2)
    if not seen.any():
        return 0
    scale = max(float(np.abs(low[seen]).max()), float(np.abs(high[seen]).max()))
    tolerance = max(TOLERANCE * scale, 1e-6)
    if (high[seen] - low[seen] > tolerance).any():
        return 0  # (not one function of k - q: the rows disagree at one distance)
    middle = low.shape[1] // 2
    value = np.where(seen, np.fmax(np.abs(low), np.abs(high)), 0.0)
    for side, part in ((1, slice(middle + 1, None)), (-1, slice(None, middle))):
        other = slice(None, middle) if side == 1 else slice(middle + 1, None)
        flat = seen[:, part].all(axis=0)  # (a distance every head sees)
        if flat.sum() >= 2 and seen[:, other].any(axis=0).sum() >= 2 and not (value[:, part] > tolerance).any() \
                and (value[:, other] > tolerance).any():
            return side
    return 0


def _crossed(call, side: int) -> tuple[int, int, int] | None:
    """The first (batch row, query, key) where a real query sees a real key on the side the bias never tells apart,
    where every real query with a real key on that side sees one; None otherwise."""
    cells = keep(call)
    if cells is None:
        return None
    q_len, k_len = call.shape[2:]
    rows = cells.any(axis=1)  # (b, Lq, Lk): a head that sees it
    own = np.arange(q_len)
    real = rows[:, own, own]  # (b, L): a query that sees its own key; its key is real
    ahead = band(q_len, k_len, 1, True) if side == 1 else band(q_len, k_len, -1, False)
    beyond = ahead[None] & real[:, None, :] & real[:, :, None]  # (b, Lq, Lk): real keys on that side of real queries
    can = beyond.any(axis=2)
    sees = (rows & beyond).any(axis=2)
    if not can.any() or (can & ~sees).any():
        return None  # (some query keeps to its side: a prefix LM's later rows, a causal mask)
    b, q, k = np.argwhere(rows & beyond)[0]
    return int(b), int(q), int(k)


def one_sided(run: Run) -> list:
    """(call, Finding) for the first full pass whose bias tells one side apart only while its mask sees the other side
    (said once, with the number of call sites)."""
    hits = []
    for call in sorted([*run.calls, *run.unmasked], key=lambda one: one.index):
        bias = call.details.get("position_bias")
        q_len, k_len = call.shape[2:]
        if not bias or q_len != k_len or q_len < 3 or call.stored is None or cross(call):
            continue
        side = _sides(bias)
        cell = _crossed(call, side) if side else None
        if cell is not None:
            hits.append((call, side, cell))
    if not hits:
        return []
    call, side, cell = hits[0]
    sites = len({one.where for one, _, _ in hits})
    later = "later" if side == 1 else "earlier"
    return [(call, Finding("position-bias-one-sided", (
        f"{call.where} adds a relative-position bias that gives every {later} key the value of the query's own key "
        f"(one bucket for all k - q {'>' if side == 1 else '<'} 0, on every head) and tells only the other side's "
        f"distances apart: a model that never looks {'ahead' if side == 1 else 'back'}; yet its mask lets every real "
        f"query see {later} keys (batch row {cell[0]}: query {cell[1]} sees key {cell[2]}; {sites} call site"
        f"{'s' if sites > 1 else ''}): the {'causal' if side == 1 else 'anti-causal'} mask is missing, or the bias "
        f"was built one-sided for a layer meant to attend both ways (x-transformers#10's inverted `causal` test)"),
        expected=f"{'causal' if side == 1 else 'no earlier key'}", source=f"the position bias added at {call.where}",
        cell=cell))]


RULES = (
    Rule("position-bias-one-sided", "wrong", "steps", "a full pass whose relative-position bias gives every later key "
         "the query's own value (unidirectional T5 buckets) while its mask lets each query see later keys "
         "(lucidrains/audiolm-pytorch 9cd86d2: no causal mask)", one_sided),
)
