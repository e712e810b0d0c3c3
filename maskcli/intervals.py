"""Per-row key intervals: the exact, O(L) form of a mask.

The keys a query row may attend to are a few sorted, disjoint, half-open intervals
`[start, end)` of absolute key positions. A mask's rows are stored as two int64 arrays
`starts` and `ends` of shape (B, Lq, K): K is the most intervals any row has, and a row
with fewer is padded with empty intervals `[k_end, k_end)`, which sort last. B and Lq
may be 1 where every batch row, or every query row, is the same (they broadcast).

`&`, `|` and `~` act on intervals directly (intersection, union and complement within
the keys `[k_start, k_end)`), so a 1M-token mask is a few million integers, not 10^12
cells. Everything here is numpy, vectorised over rows: no Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAIRWISE = 16  # intersect pairwise up to this many pairs per row; past it, by complements and a union
MAX_PER_ROW = 64  # more intervals than this in a row and they are no longer "few": use the predicate
ROW_BUDGET = 1 << 22  # rows x keys-edges processed at once when counting per block


class NotFew(Exception):
    """A row would need more than MAX_PER_ROW intervals; the message says why (for the user)."""


@dataclass(frozen=True, eq=False)
class Intervals:
    """Sorted, disjoint, non-touching key intervals per (batch row, query row); see the module docstring."""

    starts: np.ndarray  # int64 (B, Lq, K)
    ends: np.ndarray  # int64 (B, Lq, K)
    k_start: int
    k_end: int

    @classmethod
    def of(cls, starts, ends, k_start: int, k_end: int) -> Intervals:
        """Normalise any intervals (unsorted, overlapping, out of range, empty) broadcast to 3-D."""
        starts, ends = np.broadcast_arrays(_three_d(starts), _three_d(ends))
        return _normal(starts, ends, k_start, k_end)

    @classmethod
    def everything(cls, k_start: int, k_end: int) -> Intervals:
        return cls.of(np.array(k_start), np.array(k_end), k_start, k_end)

    @property
    def per_row(self) -> int:
        """K: the most intervals a row has (at least 1, an empty one)."""
        return self.starts.shape[-1]

    @property
    def shape(self) -> tuple[int, int]:
        """(B, Lq) as stored: 1 where it broadcasts."""
        return self.starts.shape[0], self.starts.shape[1]

    def __and__(self, other: Intervals) -> Intervals:
        self._same_keys(other)
        if self.per_row * other.per_row <= PAIRWISE:
            # intersections of pairs from two disjoint lists are disjoint: no merge needed, only order
            a_s, b_s = _broadcast_rows(self.starts, other.starts)
            a_e, b_e = _broadcast_rows(self.ends, other.ends)
            lead = a_s.shape[:-1]
            starts = np.maximum(a_s[..., :, None], b_s[..., None, :]).reshape(lead + (-1,))
            ends = np.minimum(a_e[..., :, None], b_e[..., None, :]).reshape(lead + (-1,))
            return _normal(starts, ends, self.k_start, self.k_end, disjoint=True)
        return ~(~self | ~other)

    def __or__(self, other: Intervals) -> Intervals:
        self._same_keys(other)
        a_s, b_s = _broadcast_rows(self.starts, other.starts)
        a_e, b_e = _broadcast_rows(self.ends, other.ends)
        if self.per_row == 1 and other.per_row == 1:
            return _union_of_two(a_s, a_e, b_s, b_e, self.k_start, self.k_end)
        return _normal(np.concatenate([a_s, b_s], -1), np.concatenate([a_e, b_e], -1), self.k_start, self.k_end)

    def __invert__(self) -> Intervals:
        lead = self.starts.shape[:-1] + (1,)
        starts = np.concatenate([np.full(lead, self.k_start, np.int64), self.ends], -1)
        ends = np.concatenate([self.starts, np.full(lead, self.k_end, np.int64)], -1)
        return _normal(starts, ends, self.k_start, self.k_end, disjoint=True, ordered=True)

    def _same_keys(self, other: Intervals) -> None:
        if (self.k_start, self.k_end) != (other.k_start, other.k_end):
            raise ValueError(f"intervals over keys [{self.k_start}, {self.k_end}) and [{other.k_start}, {other.k_end}) do not combine")

    def counts(self) -> np.ndarray:
        """Visible keys per row, int64 (B, Lq) as stored (broadcast dimensions stay 1); computed once, read-only
        (a summary asks once per batch row)."""
        cached = self.__dict__.get("_counts")
        if cached is None:
            cached = (self.ends - self.starts).sum(-1)
            cached.flags.writeable = False
            self.__dict__["_counts"] = cached
        return cached

    def rows(self, batch: int, q_lo: int, q_hi: int) -> Intervals:
        """Rows q_lo..q_hi-1 (local indices) of one batch row, as (1, n, K) intervals."""
        b = batch if self.starts.shape[0] > 1 else 0
        if self.starts.shape[1] == 1:
            s = np.broadcast_to(self.starts[b : b + 1], (1, q_hi - q_lo, self.per_row))
            e = np.broadcast_to(self.ends[b : b + 1], (1, q_hi - q_lo, self.per_row))
        else:
            s, e = self.starts[b : b + 1, q_lo:q_hi], self.ends[b : b + 1, q_lo:q_hi]
        return Intervals(s, e, self.k_start, self.k_end)

    def row(self, batch: int, q: int) -> list[tuple[int, int]]:
        """The non-empty intervals of one row (local query index), as Python pairs."""
        one = self.rows(batch, q, q + 1)
        return [(int(s), int(e)) for s, e in zip(one.starts[0, 0], one.ends[0, 0]) if s < e]

    def dense(self, batch: int, q_lo: int, q_hi: int, k_lo: int | None = None, k_hi: int | None = None) -> np.ndarray:
        """Bool (q_hi - q_lo, k_hi - k_lo): the cells of one batch row's rows, keys as absolute positions."""
        k_lo = self.k_start if k_lo is None else k_lo
        k_hi = self.k_end if k_hi is None else k_hi
        part = self.rows(batch, q_lo, q_hi)
        keys = np.arange(k_lo, k_hi, dtype=np.int64)
        out = np.zeros((q_hi - q_lo, k_hi - k_lo), dtype=bool)
        for k in range(self.per_row):  # K is small: a pass per interval column, vectorised over cells
            out |= (keys >= part.starts[0, :, k, None]) & (keys < part.ends[0, :, k, None])
        return out

    def block_counts(self, batch: int, q_len: int, row_block: int, key_block: int) -> np.ndarray:
        """Exact visible cells per block: int64 (ceil(Lq / row_block), ceil(Lk / key_block)).

        Block (i, j) covers local query rows i*row_block.. and keys k_start + j*key_block..;
        the last row and column of blocks may be shorter. Each interval adds its two end
        blocks directly and the whole blocks between them through a running sum, so the
        work is O(rows x K + blocks), and rows are taken a band of blocks at a time, within
        ROW_BUDGET numbers.
        """
        n_rows = -(-q_len // row_block)
        n_cols = -(-(self.k_end - self.k_start) // key_block)
        width = n_cols + 1
        out = np.zeros((n_rows, n_cols), dtype=np.int64)
        per_band = max(1, ROW_BUDGET // max(row_block * self.per_row, width))
        for first in range(0, n_rows, per_band):
            last = min(n_rows, first + per_band)
            lo, hi = first * row_block, min(q_len, last * row_block)
            part = self.rows(batch, lo, hi)
            s = part.starts[0] - self.k_start
            e = part.ends[0] - self.k_start
            row = np.broadcast_to((np.arange(lo, hi) // row_block - first)[:, None] * width, s.shape)
            real = s < e
            js, je = s // key_block, (e - 1) // key_block
            one = js == je
            ends = real & ~one
            inner = real & (je > js + 1)
            size = (last - first) * width
            direct = np.bincount(
                np.concatenate([(row + js)[real], (row + je)[ends]]),
                weights=np.concatenate([np.where(one, e - s, (js + 1) * key_block - s)[real], (e - je * key_block)[ends]]),
                minlength=size,
            )
            between = np.bincount(
                np.concatenate([(row + js + 1)[inner], (row + je)[inner]]),
                weights=np.concatenate([np.full(inner.sum(), key_block), np.full(inner.sum(), -key_block)]),
                minlength=size,
            )
            counts = direct.reshape(-1, width) + np.cumsum(between.reshape(-1, width), axis=1)
            out[first:last] = np.rint(counts[:, :n_cols]).astype(np.int64)
        return out


    def block_sets(self, q_len: int, q_block: int, kv_block: int) -> tuple[Intervals, Intervals]:
        """Per block of q_block query rows, the key blocks any row sees some of, and those every row sees whole.

        Both are intervals over key-block indices [0, ceil(Lk / kv_block)), one row per query
        block and one plane per stored batch row (B, ceil(Lq / q_block), K), as FlexAttention's
        block mask counts them: the sequence is padded with hidden cells to whole blocks, so a
        block cut short by the end of the queries or keys is never full. Every batch row at
        once: 60,000 padded rows are one pass, not a Python loop.
        """
        if q_block > q_len:  # one query block, padded with hidden rows: none full, and the padding is never built
            touched, whole = self.block_sets(q_len, q_len, kv_block)
            return touched, whole & ~touched
        n_q = -(-q_len // q_block)
        n_kv = -(-(self.k_end - self.k_start) // kv_block)
        starts = np.broadcast_to(self.starts, (self.starts.shape[0], q_len, self.per_row))
        ends = np.broadcast_to(self.ends, starts.shape)
        s, e = starts - self.k_start, ends - self.k_start
        batch = s.shape[0]
        real = s < e
        pad = [(0, 0), (0, n_q * q_block - q_len), (0, 0)]  # the padding rows see nothing
        touched_s = np.pad(np.where(real, s // kv_block, n_kv), pad, constant_values=n_kv)
        touched_e = np.pad(np.where(real, (e - 1) // kv_block + 1, n_kv), pad, constant_values=n_kv)
        width = touched_s.shape[2] * q_block
        touched = Intervals.of(touched_s.reshape(batch, n_q, width), touched_e.reshape(batch, n_q, width), 0, n_kv)
        whole = Intervals.of(
            np.pad(-(-s // kv_block), pad, constant_values=n_kv),
            np.pad(np.where(real, e // kv_block, 0), pad, constant_values=n_kv),
            0, n_kv,
        )
        gaps = ~whole  # per row: the blocks it does not see whole; their union per query block is what is not full
        k = gaps.per_row
        joined = Intervals.of(gaps.starts.reshape(batch, n_q, q_block * k), gaps.ends.reshape(batch, n_q, q_block * k), 0, n_kv)
        return touched, ~joined


def stacked(found: list[Intervals], q_len: int, k_len: int) -> Intervals:
    """Intervals of one batch row each, over keys [0, k_len), as one (N, Lq, K): a batch row per one of them, each
    padded with empty intervals [k_end, k_end) to the widest."""
    width = max([item.starts.shape[-1] for item in found])
    starts = np.full((len(found), q_len, width), k_len, dtype=np.int64)
    ends = starts.copy()
    for n, item in enumerate(found):
        starts[n, :, : item.starts.shape[-1]] = item.starts[0]
        ends[n, :, : item.ends.shape[-1]] = item.ends[0]
    return Intervals(starts, ends, 0, k_len)


def same_each(got: Intervals, want: Intervals) -> np.ndarray:
    """Bool (N,): whether each batch row of `got` holds the cells of `want`'s one, counted per row (as many in each,
    and all of them in both)."""
    counts = want.counts()
    same = (got.counts() == counts).all(axis=1)
    chosen = np.flatnonzero(same)  # as many cells in each row: only these are intersected (few, often none)
    if len(chosen):
        alike = Intervals(got.starts[chosen], got.ends[chosen], got.k_start, got.k_end)
        same[chosen] = ((alike & want).counts() == counts).all(axis=1)
    return same


def ordered(intervals: Intervals, n: int) -> np.ndarray:
    """int32 (rows, n), or (B, rows, n) for B > 1 batch rows: per row, the indices inside the intervals ascending, then the others ascending.

    What FlexAttention's kv_indices hold (a stable descending argsort of a 0/1 row). A row
    is a few runs of consecutive indices, index = position + shift with the shift constant
    on each run: the shifts go in at the runs' first positions and a running sum spreads
    them, so the work is one pass over the output.
    """
    planes, rows = intervals.starts.shape[:2]
    if planes > 1:  # every batch row as one long run of rows
        flat = Intervals(intervals.starts.reshape(1, planes * rows, -1), intervals.ends.reshape(1, planes * rows, -1),
                         intervals.k_start, intervals.k_end)
        return ordered(flat, n).reshape(planes, rows, n)
    outside = ~intervals
    starts = np.concatenate([intervals.starts[0], outside.starts[0]], axis=1)
    lengths = np.concatenate([intervals.ends[0] - intervals.starts[0], outside.ends[0] - outside.starts[0]], axis=1)
    positions = np.cumsum(lengths, axis=1) - lengths  # where each run begins in the output row
    shifts = starts - positions
    steps = np.diff(shifts, axis=1, prepend=0)  # an empty run's step cancels against the next one's at the same position
    inside = positions < n  # steps at n would only follow the last run
    flat = (np.arange(rows)[:, None] * n + positions)[inside]
    where, which = np.unique(flat, return_inverse=True)  # an empty run shares its position with the next run
    out = np.zeros((rows, n), dtype=np.int32)
    out.ravel()[where] = np.bincount(which, weights=steps[inside]).astype(np.int32)
    np.cumsum(out, axis=1, dtype=np.int32, out=out)
    out += np.arange(n, dtype=np.int32)
    return out


def _three_d(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.int64)
    while array.ndim < 3:
        array = array[..., None] if array.ndim == 2 else array.reshape((1,) * (3 - array.ndim) + array.shape)
    return array


def _broadcast_rows(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast (B, Lq) of two (B, Lq, K) arrays, keeping each its own K."""
    lead = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    return np.broadcast_to(a, lead + a.shape[-1:]), np.broadcast_to(b, lead + b.shape[-1:])


def _union_of_two(a_s, a_e, b_s, b_e, k_start: int, k_end: int) -> Intervals:
    """Union of one interval per row with one interval per row, without a sort (empties are [k_end, k_end))."""
    a_first = a_s <= b_s
    s1, e1 = np.where(a_first, a_s, b_s), np.where(a_first, a_e, b_e)
    s2, e2 = np.where(a_first, b_s, a_s), np.where(a_first, b_e, a_e)
    merged = s2 <= e1  # they overlap or touch (an empty second one starts at k_end: merged only into one that ends there)
    end = np.where(merged, np.maximum(e1, e2), e1)
    s2 = np.where(merged, k_end, s2)
    e2 = np.where(merged, k_end, e2)
    if not (s2 < e2).any():
        return Intervals(np.ascontiguousarray(s1), np.ascontiguousarray(end), int(k_start), int(k_end))
    return Intervals(np.concatenate([s1, s2], -1), np.concatenate([end, e2], -1), int(k_start), int(k_end))


def _normal(starts: np.ndarray, ends: np.ndarray, k_start: int, k_end: int, disjoint: bool = False, ordered: bool = False) -> Intervals:
    """Clip to [k_start, k_end), drop empties, sort, merge overlapping or touching intervals, trim K.

    `disjoint`: no two intervals overlap (touching ones may stay apart only when they
    come from a complement, which never makes touching ones); `ordered`: already sorted
    by start. Either saves work on the common paths.
    """
    s = np.minimum(np.maximum(starts, k_start), k_end)
    e = np.minimum(np.maximum(ends, k_start), k_end)
    empty = s >= e
    if s.shape[-1] == 1:
        s = np.where(empty, k_end, s)
        e = np.where(empty, k_end, e)
        return Intervals(np.ascontiguousarray(s), np.ascontiguousarray(e), int(k_start), int(k_end))
    lead, width = s.shape[:-1], s.shape[-1]
    s, e, empty = s.reshape(-1, width), e.reshape(-1, width), empty.reshape(-1, width)
    if disjoint:
        if not ordered:
            key = np.where(empty, k_end, s)
            order = np.argsort(key, axis=-1, kind="stable")
            s, e, empty = (np.take_along_axis(a, order, -1) for a in (s, e, empty))
        out_s, out_e = _compact(s, e, ~empty, k_end)
    else:
        s = np.where(empty, k_end, s)
        e = np.where(empty, k_end, e)
        order = np.argsort(s, axis=-1, kind="stable")
        s = np.take_along_axis(s, order, -1)
        e = np.take_along_axis(e, order, -1)
        reach = np.maximum.accumulate(e, axis=-1)  # the furthest end so far: a start beyond it opens a new interval
        new = np.ones(s.shape, dtype=bool)
        new[:, 1:] = s[:, 1:] > reach[:, :-1]
        last = np.ones(s.shape, dtype=bool)  # the last entry of each merged group carries its end
        last[:, :-1] = new[:, 1:]
        out_s, _ = _compact(s, s, new, k_end)
        out_e, _ = _compact(reach, reach, last, k_end)
    keep = max(1, int(np.max((out_s < out_e).sum(-1), initial=0)))
    s, e = out_s[:, :keep].reshape(lead + (keep,)), out_e[:, :keep].reshape(lead + (keep,))
    return Intervals(np.ascontiguousarray(s), np.ascontiguousarray(e), int(k_start), int(k_end))


def _compact(s: np.ndarray, e: np.ndarray, chosen: np.ndarray, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the chosen entries moved to the front in order; the rest filled with `fill`."""
    width = max(1, int(chosen.sum(-1).max(initial=0)))
    order = np.argsort(~chosen, axis=-1, kind="stable")[:, :width]  # a stable sort of a bool key is a compaction
    kept = np.take_along_axis(chosen, order, -1)
    out_s = np.where(kept, np.take_along_axis(s, order, -1), fill)
    out_e = np.where(kept, np.take_along_axis(e, order, -1), fill)
    return out_s, out_e


def check_few(intervals: Intervals, what: str) -> Intervals:
    """Raise NotFew when a row needs more than MAX_PER_ROW intervals."""
    if intervals.per_row > MAX_PER_ROW:
        raise NotFew(f"{what} gives up to {intervals.per_row} key intervals in a row (more than {MAX_PER_ROW})")
    return intervals
