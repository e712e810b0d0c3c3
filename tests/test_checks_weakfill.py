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


def test_a_cross_attention_that_applies_tanh_after_its_minus_inf_fill_is_found(tmp_path):
    # zinengtang/Perceiver_VL#2: 6 latents over 12 context keys, sample 1 of length 7; torch.tanh after
    # masked_fill(~mask, -inf) turns every padded key's score into -1
    found = check_bug(tmp_path, "perceiver_vl_cross_attention_tanh_after_mask_fill", "fill-masks-nothing")
    lengths = (12, 7)
    assert tuple(found[0]["cell"]) == first((2, 6, 12), lambda b, q, k: k >= lengths[b])
    assert "torch.tanh" in found[0]["message"]


def test_a_decoder_that_soft_caps_its_logits_after_the_additive_mask_is_found(tmp_path):
    # written another way: an HF-style additive finfo.min mask (causal, left-padded by 2 in row 1), then
    # cap * tanh(s / cap) with cap 5: masked cells reach the softmax as -5; rows with no real key are left out
    found = check_bug(tmp_path, "decoder_softcap_after_additive_mask", "fill-masks-nothing", folder=FILLS)
    pad = (0, 2)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: q >= pad[b] and (k > q or k < pad[b]))
    assert "-5 at the softmax" in found[0]["message"]
    cells = sum(1 for b in range(2) for q in range(pad[b], 6) for k in range(6) if k > q or k < pad[b])
    assert f"had {2 * cells} cells" in found[0]["message"]  # (2 heads)


def test_a_logit_softclamp_after_the_causal_fill_is_found(tmp_path):
    # lucidrains/x-transformers 9078611: Attend fills ~mask and the causal triangle with -finfo.max, then
    # softclamp(sim, value) = tanh(sim / value) * value lifts every filled cell to -value: the future keys are read
    found = check_bug(tmp_path, "x_transformers_attend_softclamp_after_causal_mask_leaks_future", "fill-masks-nothing")
    assert tuple(found[0]["cell"])[1:] == first((1, 16, 16), lambda b, q, k: k > q)[1:]
    assert "torch.tanh" in found[0]["message"]
    _, buggy, _ = traced(tmp_path, "x_transformers_attend_softclamp_after_causal_mask_leaks_future", False)
    assert not {"causal-flag-ignored", "decoder-mask-not-causal"} & {f["code"] for f in buggy}  # (said as the fill)


def test_an_encoder_that_clips_its_logits_after_the_padding_fill_is_found(tmp_path):
    # written another way: heads folded into the batch (torch.bmm), right-padded lengths 7 and 4, masked_fill(-inf)
    # then scores.clamp(-4, 4): every padded key reaches the softmax as -4
    found = check_bug(tmp_path, "encoder_logit_clip_after_padding_fill", "fill-masks-nothing", folder=FILLS)
    lengths = (7, 7, 7, 4, 4, 4)  # (batch row 1's three heads, folded batch-major)
    assert tuple(found[0]["cell"]) == first((6, 7, 7), lambda b, q, k: k >= lengths[b])
    assert "clamp" in found[0]["message"] and "-4 at the softmax" in found[0]["message"]
