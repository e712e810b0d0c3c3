"""Interval algebra against sets of key positions: &, |, ~, counts, cells and block counts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli.intervals import MAX_PER_ROW, Intervals, NotFew, check_few, ordered

K0, K1 = 3, 23  # keys 3..22: intervals out of range must be clipped to them


@st.composite
def interval_rows(draw, rows=3):
    """Raw (unsorted, overlapping, out-of-range, empty) intervals for a few rows, and their key sets."""
    width = draw(st.integers(1, 5))
    starts = draw(st.lists(st.lists(st.integers(-5, 30), min_size=width, max_size=width), min_size=rows, max_size=rows))
    lengths = draw(st.lists(st.lists(st.integers(-3, 12), min_size=width, max_size=width), min_size=rows, max_size=rows))
    ends = [[s + n for s, n in zip(srow, nrow)] for srow, nrow in zip(starts, lengths)]
    sets = [{k for s, e in zip(srow, erow) for k in range(max(s, K0), min(e, K1))} for srow, erow in zip(starts, ends)]
    return np.array(starts)[None], np.array(ends)[None], sets


def as_sets(intervals: Intervals) -> list[set[int]]:
    rows = intervals.starts.shape[1]
    return [set().union(*(range(s, e) for s, e in intervals.row(0, r))) for r in range(rows)]


def is_normal(intervals: Intervals) -> bool:
    """Sorted, disjoint, not touching, in range, empties last as [k_end, k_end)."""
    for s_row, e_row in zip(intervals.starts[0], intervals.ends[0]):
        real = [(s, e) for s, e in zip(s_row, e_row) if s < e]
        pad = [(s, e) for s, e in zip(s_row, e_row) if s >= e]
        if any((s, e) != (intervals.k_end, intervals.k_end) for s, e in pad):
            return False
        if list(zip(s_row, e_row))[: len(real)] != real:
            return False
        if any(s < intervals.k_start or e > intervals.k_end for s, e in real):
            return False
        if any(real[i][1] >= real[i + 1][0] for i in range(len(real) - 1)):
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(interval_rows())
def test_normal_form_holds_the_same_keys(data):
    starts, ends, sets = data
    intervals = Intervals.of(starts, ends, K0, K1)
    assert is_normal(intervals)
    assert as_sets(intervals) == sets


@settings(max_examples=200, deadline=None)
@given(interval_rows(), interval_rows())
def test_and_or_not_are_intersection_union_complement(a_data, b_data):
    a = Intervals.of(a_data[0], a_data[1], K0, K1)
    b = Intervals.of(b_data[0], b_data[1], K0, K1)
    everything = set(range(K0, K1))
    for result, expected in (
        (a & b, [x & y for x, y in zip(a_data[2], b_data[2])]),
        (a | b, [x | y for x, y in zip(a_data[2], b_data[2])]),
        (~a, [everything - x for x in a_data[2]]),
        (~~a, a_data[2]),
        (a & ~a, [set() for _ in a_data[2]]),
    ):
        assert is_normal(result)
        assert as_sets(result) == expected


@settings(max_examples=100, deadline=None)
@given(interval_rows(), interval_rows())
def test_wide_intersections_by_complement_agree(a_data, b_data):
    """Past PAIRWISE pairs, & goes by De Morgan: build wide rows by union, then intersect."""
    a = Intervals.of(a_data[0], a_data[1], K0, K1)
    b = Intervals.of(b_data[0], b_data[1], K0, K1)
    comb = a | Intervals.of(np.arange(K0, K1, 3)[None, None, :].repeat(3, 1), np.arange(K0, K1, 3)[None, None, :].repeat(3, 1) + 1, K0, K1)
    expected = [x & y for x, y in zip(as_sets(comb), b_data[2])]
    assert as_sets(comb & b) == expected


@settings(max_examples=100, deadline=None)
@given(interval_rows())
def test_counts_and_cells_match_the_sets(data):
    starts, ends, sets = data
    intervals = Intervals.of(starts, ends, K0, K1)
    assert intervals.counts()[0].tolist() == [len(s) for s in sets]
    cells = intervals.dense(0, 0, 3)
    assert cells.shape == (3, K1 - K0)
    assert [set((np.flatnonzero(row) + K0).tolist()) for row in cells] == sets


@settings(max_examples=100, deadline=None)
@given(interval_rows(rows=7), st.integers(1, 8), st.integers(1, 21))
def test_block_counts_equal_sums_of_cells(data, row_block, key_block):
    starts, ends, _ = data
    intervals = Intervals.of(starts, ends, K0, K1)
    cells = intervals.dense(0, 0, 7).astype(int)
    counts = intervals.block_counts(0, 7, row_block, key_block)
    expected = np.add.reduceat(np.add.reduceat(cells, np.arange(0, 7, row_block), 0), np.arange(0, K1 - K0, key_block), 1)
    assert np.array_equal(counts, expected)


@settings(max_examples=100, deadline=None)
@given(interval_rows(rows=7), st.integers(1, 8), st.integers(1, 21))
def test_block_sets_are_the_blocks_some_row_touches_and_every_row_covers(data, q_block, kv_block):
    starts, ends, _ = data
    intervals = Intervals.of(starts, ends, K0, K1)
    cells = intervals.dense(0, 0, 7)
    n_q, n_kv = -(-7 // q_block), -(-(K1 - K0) // kv_block)
    padded = np.zeros((n_q * q_block, n_kv * kv_block), dtype=bool)  # FlexAttention pads with hidden cells
    padded[:7, : K1 - K0] = cells
    blocks = padded.reshape(n_q, q_block, n_kv, kv_block).transpose(0, 2, 1, 3).reshape(n_q, n_kv, -1)
    touched, full = intervals.block_sets(7, q_block, kv_block)
    assert np.array_equal(touched.dense(0, 0, n_q), blocks.any(-1))
    assert np.array_equal(full.dense(0, 0, n_q), blocks.all(-1))
    kv_indices = ordered(touched & ~full, n_kv)
    partial = blocks.any(-1) & ~blocks.all(-1)
    assert np.array_equal(kv_indices, np.argsort(~partial, axis=1, kind="stable"))


def test_rows_broadcast_over_batch_and_queries():
    per_batch = Intervals.of(np.array([[[0]], [[5]]]), np.array([[[4]], [[9]]]), 0, 10)  # (2, 1, 1)
    per_query = Intervals.of(np.zeros((1, 3, 1), int), np.array([[[1], [2], [3]]]), 0, 10)  # (1, 3, 1)
    both = per_batch | per_query
    assert both.shape == (2, 3)
    assert both.row(1, 2) == [(0, 3), (5, 9)]
    assert (per_batch & per_query).row(0, 1) == [(0, 2)]
    assert (per_batch & per_query).row(1, 1) == []


def test_touching_intervals_merge_and_keys_must_match():
    merged = Intervals.of(np.array([[[0, 3]]]), np.array([[[3, 6]]]), 0, 10)
    assert merged.row(0, 0) == [(0, 6)] and merged.per_row == 1
    other = Intervals.everything(0, 9)
    try:
        merged | other
    except ValueError as error:
        assert "do not combine" in str(error)
    else:
        raise AssertionError("intervals over different keys combined")


def test_too_many_intervals_are_not_few():
    starts = np.arange(0, 2 * (MAX_PER_ROW + 1), 2)[None, None, :]
    many = Intervals.of(starts, starts + 1, 0, 1000)
    assert many.per_row == MAX_PER_ROW + 1
    try:
        check_few(many, "these labels")
    except NotFew as reason:
        assert f"more than {MAX_PER_ROW}" in str(reason)
    else:
        raise AssertionError("NotFew not raised")
