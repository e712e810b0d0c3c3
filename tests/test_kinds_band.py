"""kinds/band.py: the bidirectional sliding window, against a double loop, Hugging Face's own overlay, window(W) and
the recogniser."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from maskcli.inspect.structure import recognise
from maskcli.mask import build


@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 5))
def test_band_is_every_key_less_than_w_away_on_either_side_behind_an_offset(width, length, offset):
    built = build(f"band({width})", length=length, offset=offset or None)
    expected = [[abs(q - kv) < width for kv in range(offset + length)] for q in range(offset, offset + length)]
    assert built.dense()[0, 0].tolist() == expected
    assert built.intervals().counts()[0].tolist() == [sum(row) for row in expected]


@given(st.integers(1, 6), st.integers(1, 12))
def test_band_and_causal_is_window(width, length):
    assert np.array_equal(build(f"band({width}) & causal", length=length).dense(), build(f"window({width})", length=length).dense())


def test_band_is_hugging_faces_bidirectional_overlay_one_wider():
    """transformers/masking_utils.py sliding_window_bidirectional_overlay (line 139): abs(q_idx - kv_idx) <=
    sliding_window, the query's own key and S on either side: band(S + 1)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    torch = pytest.importorskip("torch")
    overlay = masking_utils.sliding_window_bidirectional_overlay(2)
    q, kv = torch.arange(7)[:, None], torch.arange(7)[None, :]
    assert overlay(0, 0, q, kv).tolist() == build("band(3)", length=7).dense()[0, 0].tolist()


@pytest.mark.parametrize("width", [2, 3])
def test_the_recogniser_names_a_band(width):
    q, kv = np.arange(9)[:, None], np.arange(9)[None, :]
    assert recognise((abs(q - kv) < width)[None, None], nearest=True).expression == f"band({width})"
