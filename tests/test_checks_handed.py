"""checks/handed.py: the one-sided window the function calling the kernel holds, dropped on some path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import caught, check_bug, first, traced

QUIET = Path(__file__).parent / "data" / "quiet"

BUGS = [
    # karpathy/nanochat#452: the SDPA fallback's Tq == 1 branch attends the whole cache (window_size=(8, 0) held)
    ("nanochat_sdpa_kvcache_decode_ignores_sliding_window", "window-dropped"),
    # flagos-ai/vllm-plugin-FL#489: q_len == 1 takes the unmasked path although window_left >= 0
    ("vllm_fl_txda_sdpa_decode_skips_window", "window-dropped"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_a_left_padded_batch_through_an_eager_softmax_handed_window_size(tmp_path):
    """Written otherwise: a module keeps window_size=(3, 0) and hands it to its attention function; left-padded batch,
    eager softmax; the decode path masks the padding alone. Its first cell against a loop over absolute positions:
    at the first decode step (query 6 over keys 0..6) a real key more than 3 back."""
    hit = caught(tmp_path, "window_left_decode_softmax", ("window-dropped",))
    real = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=bool)
    b, q, k = first((2, 7, 7), lambda b, q, k: q == 6 and real[b, k] and q - k > 3)
    assert tuple(hit["cell"]) == (b, q, k) and hit["expected"] == "window(4)"


def test_a_global_layer_beside_a_local_one_keeps_no_window(tmp_path):
    """Gemma 2 style, hand-written: one attend() holds window_size=(3, 0) for every layer and the global layer passes
    use_window=False. Layer 0 keeps to the window at that step, so layer 1's causal mask is a choice per layer, not a
    window dropped on a path: no window-dropped (the decode shortcut that drops it is still caught above)."""
    status, found, report = traced(tmp_path, "window_held_global_layer", False, QUIET)
    assert [f for f in found if f["code"] == "window-dropped"] == [], report
    assert status == 0, report
    assert "window(4)" in report and " causal\n" in report
