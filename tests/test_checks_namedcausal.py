"""checks/namedcausal.py: a mask the model call is handed under a causal name that keeps later keys, seen by its
self-attention; caught in the published bug's reproduction and in a program written another way, quiet on the fixes,
the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

NAMED = Path(__file__).parent / "data" / "namedcausal"


def test_sparknlp_marian_decoder_causal_mask_filled_with_zeros(tmp_path):
    # JohnSnowLabs/spark-nlp#2149 (written blind, batch blind-bq): `decoder_causal_mask` all 0.0 at every greedy step,
    # added to the exported decoder's scores; the fix puts -inf above the diagonal
    found = check_bug(tmp_path, "sparknlp_marian_decoder_causal_mask_all_zeros", "named-causal-sees-later")
    lengths = [2, 3, 4, 5, 6, 7, 8]  # the decoder's inputs at greedy steps 1-7 (step 0 has one token: nothing later)
    assert len(found) == len(lengths)
    for hit, length in zip(found, lengths):
        assert tuple(hit["cell"]) == first((2, length, length), lambda b, q, k: k > q)
        later = length * (length - 1) // 2
        assert f"keeps {later} cell" in hit["message"] and f"({2 * later} such cells)" in hit["message"]
        assert "`decoder_causal_mask`" in hit["message"]


def test_a_causal_mask_whose_masked_fill_result_was_dropped_over_a_padded_batch(tmp_path):
    found = check_bug(tmp_path, "gpt_sdpa_causal_mask_masked_fill_result_dropped", "named-causal-sees-later", NAMED)
    lengths = (6, 4)  # right-padded: row 1's padding keys are masked by the model's padding bias
    seen = [(b, q, k) for b in range(2) for q in range(6) for k in range(6) if q < k < lengths[b]]
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: (b, q, k) in seen)
    assert f"({len(seen)} such cells)" in found[0]["message"] and "`causal_mask`" in found[0]["message"]
