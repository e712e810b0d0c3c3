"""How two masks differ: the cells only A allows, only B allows, and both; the first rows that differ.

Two expressions are compared on their key intervals (A & ~B, B & ~A, A & B), so the
answer is exact at any length; a tensor or a mask_mod is compared cell by cell, a band of
rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskcli.counting import bands, check_cell_by_cell
from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.mask import Mask

FIRST_ROWS = 5


@dataclass(frozen=True)
class RowDifference:
    batch: int
    head: int
    query: int  # absolute position
    a: list[tuple[int, int]]  # what A sees: [start, end) intervals of absolute keys
    b: list[tuple[int, int]]
    only_a: list[tuple[int, int]]
    only_b: list[tuple[int, int]]


@dataclass(frozen=True)
class Difference:
    a: Mask
    b: Mask
    only_a: int  # cells, over every batch row and head
    only_b: int
    both: int
    rows: list[RowDifference] = field(default_factory=list)
    exact_intervals: bool = True

    @property
    def equal(self) -> bool:
        return self.only_a == 0 and self.only_b == 0

    @property
    def heads(self) -> int:
        return max(self.a.shape[1], self.b.shape[1])

    @property
    def how(self) -> str:
        return "exact, from key intervals" if self.exact_intervals else "exact, cell by cell"


def _spans(intervals: list[tuple[int, int]]) -> str:
    return ", ".join(f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in intervals) or "nothing"


def _keys(intervals: list[tuple[int, int]]) -> str:
    count = sum(e - s for s, e in intervals)
    return f"key{'s' if count > 1 else ''} {_spans(intervals)}"


def row_words(difference: Difference, a: str = "A", b: str = "B") -> list[str]:
    """'row 7: A sees 4-7, B sees 5-7: B hides key 4' for the first rows that differ (A and B named `a`, `b`)."""
    lines = []
    many = difference.a.batch > 1 or difference.b.batch > 1
    for row in difference.rows:
        where = f"batch {row.batch} " if many else ""
        where += f"head {row.head} " if row.head else ""
        hides = []
        if row.only_a:
            hides.append(f"{b} hides {_keys(row.only_a)}")
        if row.only_b:
            hides.append(f"{a} hides {_keys(row.only_b)}")
        lines.append(f"{where}row {row.query}: {a} sees {_spans(row.a)}, {b} sees {_spans(row.b)}: {'; '.join(hides)}")
    return lines


SAME_POSITIONS = "give both the same --len, --offset, --kv-start and --kv-len (a tensor's shape says its own)"


def check_comparable(a: Mask, b: Mask, advice: str = SAME_POSITIONS) -> None:
    """Refuse masks over different cells; `advice` says how to make them the same (it depends on where they came from)."""
    fa, fb = a.frame, b.frame
    if (fa.q_start, fa.q_len, fa.k_start, fa.k_len) != (fb.q_start, fb.q_len, fb.k_start, fb.k_len):
        raise MaskError(f"A and B do not cover the same cells: A has {fa.describe()}, B has {fb.describe()}: {advice}")
    for axis, x, y in (("batch rows", a.batch, b.batch), ("heads", a.heads, b.heads)):
        if x != y and 1 not in (x, y):
            raise MaskError(f"A has {x} {axis} and B has {y}: each must be 1 or the same")


def runs(row: np.ndarray, start: int) -> list[tuple[int, int]]:
    """[start, end) runs of True in a bool row, as absolute positions."""
    edges = np.diff(row.astype(np.int8), prepend=0, append=0)
    return [(int(start + s), int(start + e)) for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def compare(a: Mask, b: Mask, first: int = FIRST_ROWS, progress=None, advice: str = SAME_POSITIONS) -> Difference:
    check_comparable(a, b, advice)
    batch = max(a.batch, b.batch)
    heads_apart = max(a.keep.shape[1] if a.keep is not None else 1, b.keep.shape[1] if b.keep is not None else 1)
    heads = max(a.heads, b.heads)
    if a.exact and b.exact:
        return _by_intervals(a, b, batch, heads, first)
    f = a.frame
    only_a = only_b = both = 0
    rows: list[RowDifference] = []
    check_cell_by_cell((a, b), batch * heads_apart)
    total = batch * heads_apart * f.q_len
    done = 0
    for bi in range(batch):
        for h in range(heads_apart):
            weight = heads if heads_apart == 1 else 1
            for lo, hi in bands((a, b), f.q_len, progress, done, total):
                ca, cb = a.cells(min(bi, a.batch - 1), h, lo, hi), b.cells(min(bi, b.batch - 1), h, lo, hi)
                oa, ob = ca & ~cb, cb & ~ca
                only_a += int(oa.sum()) * weight
                only_b += int(ob.sum()) * weight
                both += int((ca & cb).sum()) * weight
                for i in np.flatnonzero((oa | ob).any(axis=1))[: max(0, first - len(rows))]:
                    rows.append(RowDifference(bi, h, f.q_start + lo + int(i), runs(ca[i], f.k_start), runs(cb[i], f.k_start),
                                              runs(oa[i], f.k_start), runs(ob[i], f.k_start)))
            done += f.q_len
    return Difference(a, b, only_a, only_b, both, rows, exact_intervals=False)


def _by_intervals(a: Mask, b: Mask, batch: int, heads: int, first: int) -> Difference:
    ia, ib = a.intervals(), b.intervals()
    only_a, only_b, both = ia & ~ib, ib & ~ia, ia & ib
    f = a.frame

    def total(intervals: Intervals) -> int:
        counts = np.broadcast_to(intervals.counts(), (batch, f.q_len))
        return int(counts.sum()) * heads

    rows: list[RowDifference] = []
    differs = np.broadcast_to(only_a.counts() + only_b.counts(), (batch, f.q_len)) > 0
    for bi, q in zip(*np.nonzero(differs)):
        if len(rows) == first:
            break
        bi, q = int(bi), int(q)
        rows.append(RowDifference(bi, 0, f.q_start + q, ia.row(bi, q), ib.row(bi, q), only_a.row(bi, q), only_b.row(bi, q)))
    return Difference(a, b, total(only_a), total(only_b), total(both), rows)


def categories(difference: Difference, b: int, h: int, q_lo: int, q_hi: int) -> np.ndarray:
    """int8 (rows, Lk) of one batch row's rows: 0 neither, 1 both, 2 only A, 3 only B."""
    a, bm = difference.a, difference.b
    ca = a.cells(min(b, a.batch - 1), h, q_lo, q_hi)
    cb = bm.cells(min(b, bm.batch - 1), h, q_lo, q_hi)
    out = np.zeros(ca.shape, dtype=np.int8)
    out[ca & cb] = 1
    out[ca & ~cb] = 2
    out[cb & ~ca] = 3
    return out


def block_counts(difference: Difference, b: int, h: int, rows: int, cols: int, progress=None) -> dict[str, np.ndarray]:
    """Cells per block of rows x cols: 'both', 'only_a', 'only_b' (int64 grids), exactly."""
    from maskcli.counting import block_counts as count
    from maskcli.mask import from_tensor

    a, bm = difference.a, difference.b
    if a.exact and bm.exact:
        ia, ib = a.intervals(), bm.intervals()
        parts = {"both": ia & ib, "only_a": ia & ~ib, "only_b": ib & ~ia}
        f = a.frame
        return {name: intervals.block_counts(b, f.q_len, rows, cols) for name, intervals in parts.items()}
    f = a.frame
    check_cell_by_cell((a, bm))
    names = {"both": 1, "only_a": 2, "only_b": 3}
    out = {name: np.zeros((-(-f.q_len // rows), -(-f.k_len // cols)), dtype=np.int64) for name in names}
    for lo, hi in bands((a, bm), f.q_len, progress, align=rows):  # each band's categories once, for all three
        found = categories(difference, b, h, lo, hi)
        for name, value in names.items():
            part = from_tensor((found == value)[None, None], "part", 0, 0)
            out[name][lo // rows : lo // rows + -(-(hi - lo) // rows)] += count(part, 0, 0, rows, cols)
    return out
