"""checks/twopaths.py: one module's two attention paths over the same mask whose rows with no key differ (an -inf
fill on one, a finite fill on the other), on the published bug's reproduction (tests/data/bugs) and a program written
another way (tests/data/twopaths), each quiet fixed."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

TWOPATHS = Path(__file__).parent / "data" / "twopaths"


def test_stylish_tts_sdpa_path_filled_neg_inf_beside_its_manual_path_is_found(tmp_path):
    """Stylish-TTS/stylish-tts 6cb2c17 (written blind, batch blind-cg): the text encoder's SDPA path fills -inf where
    its manual path fills -1e4; padded phoneme rows see no key. Fixed: the SDPA path fills -1e4 too."""
    [hit] = check_bug(tmp_path, "stylish_tts_text_encoder_sdpa_inf_mask_padded_rows", "empty-rows-differ")
    assert hit["message"].startswith("encoder.attn_layers.0 attends this mask along two paths: on its sdpa path its "
                                     "query rows 7-11 of batch row 1, which see no key, are 0 out of this SDPA")
    assert "its softmax path (call 3) fills the same cells with -10000" in hit["message"]
    assert hit["cell"] == [1, 7, 0]


def test_an_encoder_fused_flag_filling_neg_inf_beside_its_eager_path_is_found(tmp_path):
    """Written another way: a BERT-style encoder's `fused` flag (SDPA, an additive pair mask of -inf) beside its eager
    path (masked_fill with finfo.min), checked against each other on a right-padded batch of three. Fixed: finfo.min."""
    [hit] = check_bug(tmp_path, "encoder_fused_flag_pair_mask_neg_inf", "empty-rows-differ", TWOPATHS)
    assert "query rows 6-8 of batch row 1" in hit["message"]
    assert "fills the same cells with the dtype's lowest value" in hit["message"]
