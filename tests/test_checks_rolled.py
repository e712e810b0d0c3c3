"""checks/rolled.py: a sliding or chunked layer over a cache whose columns are not positions, by counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug
from maskcli.checks.rolled import _expected

WINDOWS = Path(__file__).parent / "data" / "windows"


@pytest.mark.parametrize("name, code, folder", [
    ("gemma2_hybrid_cache_sliding_mask_slicing", "window-miscounted", None),  # huggingface/transformers#35681
    ("ring_buffer_window_decode", "window-miscounted", WINDOWS),  # slot = position % W, read as positions
    ("llama4_chunked_attention_cache_offset", "chunks-miscounted", None),  # huggingface/transformers#37414
    ("chunked_trimmed_cache_decode", "chunks-miscounted", WINDOWS),  # last C - 1 keys labelled from 0
])
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code, folder):
    if folder is None:
        check_bug(tmp_path, name, code)
    else:
        check_bug(tmp_path, name, code, folder)


def _counted(real, own, kind, size):
    """The real tokens each query should see, by a double loop over absolute positions."""
    rows = np.zeros((real.shape[0], len(own)), dtype=np.int64)
    for b in range(real.shape[0]):
        first = int(np.argmax(real[b]))
        for i, p in enumerate(own):
            for k in range(p + 1):
                inside = p - k < size if kind == "sliding_attention" else (p - first) // size == (k - first) // size
                rows[b, i] += bool(real[b, k]) and inside
    return rows


@pytest.mark.parametrize("kind", ["sliding_attention", "chunked_attention"])
@pytest.mark.parametrize("size", [1, 3, 4])
def test_expected_counts_against_a_double_loop(kind, size):
    real = np.array([[1] * 12, [0, 0, 0] + [1] * 9, [0] * 5 + [1] * 7], dtype=bool)
    own = np.array([5, 6, 9, 11])
    assert np.array_equal(_expected(real, own, kind, size), _counted(real, own, kind, size))
