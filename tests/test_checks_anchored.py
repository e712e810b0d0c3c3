"""checks/anchored.py: a sliding window laid on a call's own rows instead of its queries' positions, on a published
bug written blind (keras-hub) and a second program written another way (a Llama-style start_pos, a later prefill
chunk, a one-sided tril bias); each fix is quiet."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_keras_hub_cached_gemma_band_of_row_zero(tmp_path):
    # keras-team/keras-hub#1738: triu/tril band on the (1, key_len) decode mask keeps keys 0 .. W - 1 at every step;
    # the query's position is the layer call's cache_update_index (an int), the window the config's sliding_window_size
    flagged = check_bug(tmp_path, "keras_hub_gemma_cached_sliding_window_anchored_at_row0", "window-anchored-at-row")
    # query at position p (cache_update_index, from 4 on) sees keys 0-3, as the double loop over the band says
    for p in range(4, 9):
        seen = [k for k in range(10) if k <= p and abs(k - 0) < 4]
        assert any(f"position {p} sees keys {seen[0]}-{seen[-1]} " in f["message"] and f"not {p - 3}-{p}" in f["message"]
                   for f in flagged), flagged
    assert all(f["source"].startswith("sliding_window_size=4 (config (GemmaBackboneConfig) in main()") for f in flagged)


def test_a_later_prefill_chunk_given_the_window_of_its_rows(tmp_path):
    # forward(h, start_pos): the second chunk of 4 (positions 4-7) masks keys up to row - W, not start_pos + row - W
    flagged = check_bug(tmp_path, "start_pos_window_on_chunk_rows", "window-anchored-at-row", WINDOWS)
    assert [f["message"].split(": the query")[1][:32] for f in flagged] == [" at position 4 sees keys 0-4 (ro"], flagged
    assert flagged[0]["source"] == "sliding_window=3 (self.params of Transformer (ModelArgs))"
