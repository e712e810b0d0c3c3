"""checks/weakfill.py: a mask written into the scores with a fill of about zero, caught in the published bug's
reproduction (tests/data/bugs) and in a program written another way (tests/data/fills), quiet on both fixes; the
flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

FILLS = Path(__file__).parent / "data" / "fills"


def test_a_tft_decoder_that_fills_its_causal_and_observed_masks_with_plus_1e_9_is_found(tmp_path):
    # awslabs/gluonts#1401: 4 forecast queries over 8 + 4 keys, key index <= query + 8 kept; series 1's first 3
    # history steps unobserved
    found = check_bug(tmp_path, "gluonts_tft_mask_fill_positive_epsilon", "fill-masks-nothing")
    assert tuple(found[0]["cell"]) == first((2, 4, 12), lambda b, q, k: k > q + 8 or (b == 1 and k < 3))
    assert "1e-09" in found[0]["message"]


def test_an_encoder_that_masks_its_pad_keys_with_a_fill_of_zero_is_found(tmp_path):
    found = check_bug(tmp_path, "encoder_pad_masked_fill_zero", "fill-masks-nothing", folder=FILLS)
    lengths = (7, 4)
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k >= lengths[b])
    assert {f["message"].split("'")[0] for f in found} == {"layers.0", "layers.1"}


def test_a_fill_of_zero_whose_weights_are_masked_and_renormalised_after_the_softmax_is_quiet(tmp_path):
    for fixed in (False, True):
        status, found, _ = traced(tmp_path, "encoder_pad_fill_zero_renormalised", fixed, FILLS)
        assert status == 0 and [f for f in found if f["code"] == "fill-masks-nothing"] == []
