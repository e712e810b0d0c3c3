"""checks/layerwindow.py: a sliding layer whose query sees fewer keys than its window allows of the full layer's, caught
in the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/layerwindow),
quiet on both fixes; the flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

LAYERWINDOW = Path(__file__).parent / "data" / "layerwindow"


def test_executorch_qnn_sliding_window_mask_rows_never_see_the_cache(tmp_path):
    # pytorch/executorch#14411 (written blind, batch blind-cr): in SMART_MASK mode update_attention_mask's row pointer
    # never advanced, so every row update of the sliding-window mask landed on row 0
    found = check_bug(tmp_path, "executorch_qnn_kv_manager_window_mask_update_row_pointer_stuck", "window-short")
    hit = found[0]
    assert "SLIDING_WINDOW = 12" in hit["message"] and "LAYER_TYPES of the main module" in hit["message"]
    _, query, key = hit["cell"]
    # (the second chunk's first query, at position 8, sees the cache's 8 keys and its own in the full layer; the window
    # of 12 keeps all 9; the key named is a cached one the sliding layer hides)
    assert query == 8 and 0 <= key < 8 and query - key < 12


def test_a_config_stated_sliding_layer_whose_chunk_mask_drops_the_cached_keys(tmp_path):
    found = check_bug(tmp_path, "chunked_prefill_sliding_mask_drops_cache", "window-short", folder=LAYERWINDOW)
    window, chunk = 6, 4
    expected = None
    for start in range(chunk, 12, chunk):  # (a double loop: the first query whose window holds a key its chunk hides)
        for p in range(start, start + chunk):
            inside = [j for j in range(p + 1) if p - j < window]
            buggy = [j for j in inside if j >= start]
            if len(buggy) < min(p + 1, window) - 1:
                expected = (0, p, max(set(inside) - set(buggy)))
                break
        if expected:
            break
    assert tuple(found[0]["cell"]) == expected, found[0]


def test_executorch_qnn_window_update_masking_the_whole_cache_is_flagged_and_its_fix_is_quiet(tmp_path):
    """pytorch/executorch#20736 (written blind, batch blind-he): the QNN runner's KVManager re-masked every slot written
    so far once the window filled, so the sliding layer saw the current token alone: window-short, against the full
    layer of the same step. The fix was 'unwritten-slot' before (one query a step over a static cache with its own key
    appended after the 15 slots, read as slot j = position j): one query that sees the last key, not the slot at its
    own position and no other slot past the written ones is the appended layout (checks/cache.py)."""
    found = check_bug(tmp_path, "executorch_qnn_kv_manager_window_update_masks_whole_cache", "window-short")
    assert "layer 0 is a sliding layer" in found[0]["message"] and "sees 1 key" in found[0]["message"]
