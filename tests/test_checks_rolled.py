"""checks/rolled.py: a sliding or chunked layer over a cache whose columns are not positions, by counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import caught, check_bug
from maskcli.checks.rolled import _expected

WINDOWS = Path(__file__).parent / "data" / "windows"


@pytest.mark.parametrize("name, code, folder", [
    ("gemma2_hybrid_cache_sliding_mask_slicing", "window-miscounted", None),  # huggingface/transformers#35681
    # microsoft/unilm#1612 (f4f7b27; written blind, batch blind-hb; caught before any rule was changed for it): YOCO's
    # sliding-window attention handed flash_attn_func the new chunk's k, v instead of the cache's: a decode step saw
    # its own key alone (its window also one key short: window-off-by-one)
    ("yoco_swa_incremental_flash_call_gets_chunk_kv_only", "window-miscounted", None),
    ("ring_buffer_window_decode", "window-miscounted", WINDOWS),  # slot = position % W, read as positions
    ("llama4_chunked_attention_cache_offset", "chunks-miscounted", None),  # huggingface/transformers#37414
    ("chunked_trimmed_cache_decode", "chunks-miscounted", WINDOWS),  # last C - 1 keys labelled from 0
    # lablup/mlxcel#405: a prompt longer than the window, its first pass over the last W keys only (10 queries, 4 keys)
    ("mlxcel_sliding_prefill_over_window_clamped_mask", "window-miscounted", None),
    # ml-explore/mlx-lm#1673: a chunk cache trimmed on its buffer's slots drops live keys; its fix (trimmed on the
    # tokens held) was once called chunks-off-by-one, its columns read as positions after the front was trimmed
    ("mlx_llama4_chunked_kv_cache_trims_buffer_not_tokens", "chunks-miscounted", None),
    # written otherwise: a window in a dict config, two rows with an attention_mask, an eager softmax
    ("window_cache_trimmed_on_buffer_slots", "window-miscounted", WINDOWS),
    # Lightning-AI/litgpt#2182 (PR #2215): a prefill longer than the ring-buffer KVCache, the global tril truncated to
    # its 6 slots: 14 queries at input_pos 0 .. 13 over 6 keys (its fix prefills token by token: quiet)
    ("litgpt_kvcache_sliding_window_prefill_longer_than_window", "window-miscounted", None),
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


def test_a_first_pass_over_a_cache_trimmed_to_the_window(tmp_path):
    """Written otherwise: a dict config (`self.cfg`, sliding_window 3), a right-padded batch (7 and 5 real tokens), an
    eager softmax with a finite fill, the prompt's pass over the 3 keys its cache keeps. A site's first call, made by
    the model call handed its queries as token ids, places query i at position i: against a double loop over absolute
    positions, the first real query that sees fewer keys than its window holds (query 0 sees none)."""
    hit = caught(tmp_path, "window_first_pass_cache_trims_prefill", ("window-miscounted",))
    real = np.array([[1] * 7, [1] * 5 + [0] * 2], dtype=bool)
    want = _counted(real, np.arange(7), "sliding_attention", 3)
    seen = np.zeros_like(want)  # the buggy mask: the last 3 columns of the windowed causal mask, by a loop
    for b in range(2):
        for q in range(7):
            seen[b, q] = sum(1 for k in range(4, 7) if k <= q and q - k < 3 and real[b, k])
    b, q = (int(x) for x in np.argwhere((seen < want) & real)[0])
    assert f"position {q} of batch row {b}" in hit["message"] and hit["expected"] == f"{want[b, q]} keys"


def test_a_prefill_chunk_longer_than_a_ring_cache_needs_more_keys_than_it_holds(tmp_path):
    """Written otherwise: a dict config (sliding_window 4), two rows, the second left-padded by two, `cache_position`
    handed to the model call, a second prefill chunk (positions 3 .. 8) written into the 4 slots of a ring before it
    attends over them, the mask placed on the slots' positions. The keys the chunk's real queries need between them,
    by a loop over absolute positions (a set of each window's real tokens), against the 4 the cache holds."""
    hit = check_bug(tmp_path, "ring_cache_chunk_longer_than_window_left_padded", "window-miscounted", WINDOWS)[0]
    real = [[True] * 9, [False] * 2 + [True] * 7]
    need = [len({k for q in range(3, 9) if real[b][q] for k in range(q - 3, q + 1) if k >= 0 and real[b][k]})
            for b in range(2)]
    b = next(b for b in range(2) if need[b] > 4)
    assert f"batch row {b}" in hit["message"] and hit["expected"] == f"{need[b]} keys"
