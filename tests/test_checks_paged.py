"""checks/paged.py: a sliding layer over packed sequences with keys of their own (cu_seqlens_q/k)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug
from maskcli.checks.paged import _expected

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_continuous_batching_window_backwards(tmp_path):
    # huggingface/transformers#41184, fixed by #41228: the sliding diagonal added where it should be subtracted
    check_bug(tmp_path, "transformers_continuous_batching_sliding_window_mask", "window-misplaced")


def test_flash_varlen_band_on_the_wrong_side(tmp_path):
    check_bug(tmp_path, "varlen_band_wrong_side", "window-misplaced", WINDOWS)


@pytest.mark.parametrize("size", [None, 1, 3])
def test_expected_against_a_double_loop(size):
    cu_q, cu_k = np.array([0, 5, 6, 9]), np.array([0, 5, 12, 16])
    want = np.zeros((9, 16), dtype=bool)
    for s in range(3):
        for i in range(cu_q[s], cu_q[s + 1]):
            p = i - cu_q[s] + (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s])
            for j in range(cu_k[s], cu_k[s + 1]):
                back = p - (j - cu_k[s])
                want[i, j] = back >= 0 and (size is None or back < size)
    assert np.array_equal(_expected(cu_q, cu_k, size), want)
