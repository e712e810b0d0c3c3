"""window-keys-sliced (checks/slicedkeys.py): a call handed the tail of its cache's keys whose first queries see fewer
keys than the window its site lays at its prompt pass."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug

WINDOWS = Path(__file__).parent / "data" / "windows"


def _window_cells(n: int, offset: int, window: int) -> torch.Tensor:
    """The windowed-causal cells of n queries at positions offset .. offset + n - 1 over keys 0 .. offset + n - 1: a
    double loop over positions."""
    cells = torch.zeros(n, offset + n, dtype=torch.bool)
    for q in range(n):
        for k in range(offset + n):
            cells[q, k] = k <= offset + q < k + window
    return cells


def test_a_clamped_window_mask_over_a_dense_cache(tmp_path):
    """lablup/mlxcel#418 (written blind): the second prefill chunk (positions 5 .. 8) is handed the last 4 of 9 cached
    keys under a [4, 4] mask; its first query sees 1 key where its window of 4 holds 4. The fix (the full [4, 9] mask
    over every key) is quiet."""
    found = check_bug(tmp_path, "mlxcel_dense_cache_sliding_prefill_clamped_mask", "window-keys-sliced")
    want = _window_cells(4, 5, 4)
    assert int(want[0].sum()) == 4 and int(want[0, 5:].sum()) == 1  # (what the slice leaves of it: its own key)
    assert "the last 4 of 9 cached keys (positions 5 .. 8)" in found[0]["message"]
    assert "the query at position 5 (batch row 0) sees 1 key, where its window holds 4" in found[0]["message"]
    assert found[0]["cell"] == [0, 5, 2]


def test_a_chunk_handed_only_its_own_keys_under_eager_softmax(tmp_path):
    """Written another way: a hand-written q @ kᵀ + bias over a left-padded batch of two, window 3; the second chunk
    (positions 6 .. 9) is handed `k[:, :, -4:]` under a window over its own positions only. The fix (every cached
    key, the window placed at the chunk's offset) is quiet."""
    found = check_bug(tmp_path, "chunked_prefill_keys_cut_to_the_chunk", "window-keys-sliced", folder=WINDOWS)
    want = _window_cells(4, 6, 3)
    assert int(want[0].sum()) == 3 and int(want[0, 6:].sum()) == 1
    assert "the last 4 of 10 cached keys (positions 6 .. 9)" in found[0]["message"]
    assert "sees 1 key, where its window holds 3: keys 4 .. 5 are cached and sliced off" in found[0]["message"]


def test_a_window_cache_trimmed_before_a_chunk_attends(tmp_path):
    """rasbt/LLMs-from-scratch#1013 (written blind): MultiHeadAttentionWithSWA joins a 3-token chunk to its cache laid
    (B, L, H, D) and trims it to the window of 4 before the chunk attends; the second chunk (positions 3 .. 5) is handed
    keys 2 .. 5 of 6 (read off the tile's key span of q @ kᵀ) and its first query sees 2 of its window's 4 keys. The fix
    (the last W + n - 1 keys attended, the cache alone trimmed) is quiet."""
    found = check_bug(tmp_path, "llms_from_scratch_swa_kv_cache_trimmed_before_chunk_attention", "window-keys-sliced")
    want = _window_cells(3, 3, 4)
    assert int(want[0].sum()) == 4 and int(want[0, 2:].sum()) == 2  # (what the trim leaves of it)
    assert "the last 4 of 6 cached keys (positions 2 .. 5)" in found[0]["message"]
    assert "the query at position 3 (batch row 0) sees 2 keys, where its window holds 4" in found[0]["message"]
    assert found[0]["cell"] == [0, 3, 0]


def test_a_rolling_cache_trimmed_before_a_draft_verify_step(tmp_path):
    """Written another way: SDPA with an additive finfo.min mask over a left-padded batch, a rolling cache laid
    (B, H, L, D) whose update trims to the window of 4 before it returns; 3 draft tokens verified at once are handed
    the last 4 of the 7 keys held, the first seeing 2 of its 4. The fix (W + n - 1 keys returned) is quiet."""
    found = check_bug(tmp_path, "rolling_cache_trimmed_before_draft_verify", "window-keys-sliced", folder=WINDOWS)
    want = _window_cells(3, 4, 4)
    assert int(want[0].sum()) == 4 and int(want[0, 3:].sum()) == 2
    assert "the last 4 of 7 cached keys (positions 3 .. 6)" in found[0]["message"]
    assert "sees 2 keys, where its window holds 4: keys 1 .. 2 are cached and sliced off" in found[0]["message"]
