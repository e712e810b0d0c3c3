"""Captured masks as stored: any bool mask comes back cell for cell, equal masks share one digest."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from maskcli import tracefile
from maskcli.errors import MaskError
from maskcli.intervals import MAX_PER_ROW

masks = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 6), st.integers(1, 9)).flatmap(
    lambda shape: arrays(bool, shape))


@settings(max_examples=200, deadline=None)
@given(keep=masks)
def test_a_stored_mask_reads_back_cell_for_cell(keep):
    stored = tracefile.from_dense(keep, keep.shape)
    assert stored["form"] == "intervals"  # at most 5 runs in 9 keys: few
    assert np.array_equal(tracefile.dense(stored), keep)
    counts = tracefile.counts(stored)
    assert np.array_equal(counts, keep.sum(axis=-1))
    again = tracefile.from_dense(keep.copy(), keep.shape)
    assert tracefile.digest(again) == tracefile.digest(stored)


@settings(max_examples=100, deadline=None)
@given(a=masks, b=masks)
def test_different_masks_get_different_digests(a, b):
    same = a.shape == b.shape and np.array_equal(a, b)
    assert (tracefile.digest(tracefile.from_dense(a, a.shape)) == tracefile.digest(tracefile.from_dense(b, b.shape))) == same


def test_a_row_of_many_runs_is_kept_as_bits_and_reads_back():
    keep = np.zeros((1, 1, 3, 4 * MAX_PER_ROW), dtype=bool)
    keep[..., ::2] = True  # 2 * MAX_PER_ROW runs in a row: not few
    stored = tracefile.from_dense(keep, keep.shape)
    assert stored["form"] == "bits" and stored["bits"].nbytes == keep.size // 8
    assert np.array_equal(tracefile.dense(stored), keep)


@pytest.mark.parametrize(("form", "key", "shape", "dims"), [
    ("bits", "bits", (2, 6, 5), "4 dimensions (batch planes, head planes, queries, bytes of keys)"),
    ("intervals", "starts", (6, 1), "3 dimensions (planes, queries, intervals per row)"),
])
def test_a_stored_array_of_the_wrong_rank_is_refused_saying_the_rank_it_needs(tmp_path, form, key, shape, dims):
    """A crafted trace file: the line said "bits is dtype('uint8') [2, 6, 5]; it is an integer array" of an integer
    array; it now says how many dimensions, and what each is."""
    keep = np.tril(np.ones((1, 1, 6, 6), dtype=bool))
    stored = dict(tracefile.from_dense(keep, keep.shape), form=form, **{key: np.zeros(shape, np.uint8 if form == "bits" else np.int64)})
    with pytest.raises(MaskError, match=rf"{key} is dtype\('(uint8|int64)'\) \[{', '.join(map(str, shape))}\]; it is an integer array of "
                       + dims.replace("(", r"\(").replace(")", r"\)")):
        tracefile._check_mask(stored, "T.pt")
