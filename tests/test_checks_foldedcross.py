"""checks/foldedcross.py: a cross-attention that folds its batch into one sequence, whose samples see each other's
memories."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

HERE = Path(__file__).parent / "data" / "foldedcross"


def test_pixart_sdp_fallback_mixes_the_batch(tmp_path):
    """city96/ComfyUI_ExtraModels#36: the SDP fallback's float mask of zeros (with +1 entries) instead of the block
    diagonal: each image of the CFG pair attends both captions (y_lens [6, 6], keys 0-5 and 6-11)."""
    found = check_bug(tmp_path, "comfy_extramodels_pixart_sdp_cross_attention_mask_mixes_batch",
                      "samples-see-other-memories")
    assert {f["message"].split(" was handed")[0] for f in found} == {
        "the cross-attention at blocks.0.cross_attn", "the cross-attention at blocks.1.cross_attn"}
    assert "handed 2 samples of 16 queries and attends them as one sequence of 32 over 12 keys" in found[0]["message"]
    assert "query 0 (sample 0) sees key 6, of sample 1's memory" in found[0]["message"]


def test_captions_of_two_lengths_and_an_explicit_softmax(tmp_path):
    """Captions right-padded to 7 (lengths 4 and 7) gathered end to end, an explicit softmax with -inf fills: the
    mask keyed on padding the gather removed lets sample 0's queries see keys 4-10, sample 1's caption."""
    found = check_bug(tmp_path, "dit_caption_ids_folded", "samples-see-other-memories", HERE)
    assert "the 2 memories of `text_lens`" in found[0]["message"] and "[4, 7]" in found[0]["message"]
    assert found[0]["cell"] == [0, 0, 4]


def test_a_folded_batch_handed_no_mask_for_unpadded_prompts_is_found(tmp_path):
    """hpcaitech/Open-Sora#609: with mask=None (every prompt full length) no BlockDiagonalMask is built, so the 2
    videos' 32 latent tokens each attend both prompts; the memories are the layer's `cond` argument, (2, 6, C)."""
    found = check_bug(tmp_path, "opensora_cross_attention_no_mask_mixes_batch_prompts", "samples-see-other-memories")
    assert "handed 2 samples of 32 queries and attends them as one sequence of 64 over 12 keys" in found[0]["message"]
    assert "the 2 memories of `cond`" in found[0]["message"]
    own = lambda q, k: q // 32 == k // 6  # noqa: E731 - (sample of the query, sample of the key)
    assert found[0]["cell"] == [0, *next((q, k) for q in range(64) for k in range(12) if not own(q, k))]


def test_a_resampler_that_folds_three_samples_into_one_softmax_call_is_found(tmp_path):
    found = check_bug(tmp_path, "resampler_folded_batch_no_block_mask", "samples-see-other-memories", HERE)
    assert "the 3 memories of `context`" in found[0]["message"] and "[5, 5, 5]" in found[0]["message"]
    assert found[0]["cell"] == [0, *next((q, k) for q in range(12) for k in range(15) if q // 4 != k // 5)]
