"""Captured masks as stored: any bool mask comes back cell for cell, equal masks share one digest, and a selector
names one call of a saved trace."""

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


def test_selectors_name_a_call_by_index_or_module_path_and_step():
    data = {"calls": [{"index": 0, "where": "layers.0.attn", "step": 0}, {"index": 1, "where": "layers.0.attn", "step": 1}]}
    assert tracefile.select(data, "1", "t.pt")["index"] == 1
    assert tracefile.select(data, "layers.0.attn@1", "t.pt")["index"] == 1
    for bad, message in (("2", "numbered 0 to 1"), ("layers.0.attn@5", "no call of 'layers.0.attn' at step 5"), ("attn", "MODULE_PATH@STEP")):
        with pytest.raises(MaskError, match=message):
            tracefile.select(data, bad, "t.pt")
    assert tracefile.split_spec("t.pt:layers.5.self_attn@2") == ("t.pt", "layers.5.self_attn@2")
    assert tracefile.split_spec("mask.npy:3") is None and tracefile.split_spec("t.pt") is None


def test_a_call_named_by_its_file_and_line_is_found():
    from maskcli.tracefile import select, split_spec

    assert split_spec("t.pt:script.py:9") == ("t.pt", "script.py:9")
    assert split_spec("t.pt:script.py:9@1") == ("t.pt", "script.py:9@1")
    assert split_spec("runs/t.pt:7") == ("runs/t.pt", "7") and split_spec("t.npy") is None
    data = {"calls": [{"where": "script.py:9", "step": 0, "index": 0}, {"where": "m.attn", "step": 0, "index": 1},
                      {"where": "m.attn", "step": 1, "index": 2}]}
    assert select(data, "script.py:9", "t.pt")["index"] == 0
    assert select(data, "m.attn@1", "t.pt")["index"] == 2
    with pytest.raises(MaskError, match=r"m.attn made 2 calls \(steps 0, 1\): name one as t.pt:m.attn@STEP"):
        select(data, "m.attn", "t.pt")
