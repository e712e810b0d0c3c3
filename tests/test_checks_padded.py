"""checks/padded.py: a padding mask the model call's zero-padded input confirms, never reaching its attention, caught
in the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/padded), quiet
on the fixes, on zeros with no mask and on a mask over samples that are not zero; the flagged cell against a double
loop."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug, first, traced
from maskcli.checks.registry import severity

PADDED = Path(__file__).parent / "data" / "padded"


def test_a_forecasters_padding_mask_handed_as_the_reconstruction_mask_is_found(tmp_path):
    # sktime/sktime#10685: 16 real steps of 32 in 4 patches of 8, each of 2 channels a batch row; input_mask defaulted
    found = check_bug(tmp_path, "sktime_momentfm_predict_input_mask_passed_as_mask", "zero-padding-attended")
    assert tuple(found[0]["cell"]) == first((2, 4, 4), lambda b, q, k: q < 2 and k >= 2)
    assert "samples 16-31" in found[0]["message"] and "`x_enc`" in found[0]["message"]


def test_left_padded_features_whose_input_mask_the_model_never_reads_are_found(tmp_path):
    # written otherwise: (B, S, C) features left-padded, a float input_mask, two frames a key, SDPA with no mask
    found = check_bug(tmp_path, "left_padded_features_input_mask_unread", "zero-padding-attended", folder=PADDED)
    pads = (0, 2)  # keys of padding in each row (4 of 8 frames padded in row 1)
    assert tuple(found[0]["cell"]) == first((2, 4, 4), lambda b, q, k: q >= pads[b] and k < pads[b])


def test_dmrs_causal_padding_mask_built_and_never_applied_is_found(tmp_path):
    # reczoo/FuxiCTR 9d89a67 (#130): User2ItemNet's get_mask() is built, its masked_fill commented out; left padding
    found = check_bug(tmp_path, "fuxictr_dmr_user2item_causal_padding_mask_never_applied", "zero-padding-attended")
    seqs = [[0, 0, 0, 5, 9, 3, 17, 2], [0, 0, 0, 0, 0, 11, 4, 8], [6, 13, 7, 21, 30, 1, 19, 25]]  # 0 = padding
    assert tuple(found[0]["cell"]) == first((3, 8, 8), lambda b, q, k: seqs[b][q] != 0 and seqs[b][k] == 0)
    assert "`mask`" in found[0]["message"] and "`sequence_emb`" in found[0]["message"]


def test_a_float_causal_padding_mask_built_and_never_added_to_einsum_scores_is_found(tmp_path):
    # written otherwise: right padding by pad_sequence, a float (B, L, L) mask built, never added; einsum scores
    found = check_bug(tmp_path, "right_padded_history_causal_mask_built_never_added", "zero-padding-attended",
                      folder=PADDED)
    lengths = (5, 2, 7)
    assert tuple(found[0]["cell"]) == first((3, 7, 7), lambda b, q, k: q < lengths[b] <= k)


def test_moments_insample_mask_in_the_batch_dict_never_handed_to_the_module_is_found(tmp_path):
    # Nixtla/neuralforecast#1014 (8fad5f4): MOMENT.forward called self.moment(x_enc) without input_mask; the padding is
    # windows_batch["insample_mask"] beside windows_batch["insample_y"], left-padded 8 of 32 steps: 4 patches of 8
    found = check_bug(tmp_path, "neuralforecast_moment_insample_mask_not_passed", "zero-padding-attended")
    pads = (0, 1)  # patches of padding in each row (samples 0-7 of row 1)
    assert tuple(found[0]["cell"]) == first((2, 4, 4), lambda b, q, k: q >= pads[b] and k < pads[b])
    assert '`windows_batch["insample_mask"]`' in found[0]["message"] and '`windows_batch["insample_y"]`' in found[0]["message"]


def test_a_classifiers_available_mask_in_the_batch_dict_never_handed_to_its_encoder_is_found(tmp_path):
    # written otherwise: a collate that right-pads series with zeros, batch["available_mask"], one token per step,
    # nn.TransformerEncoder called without src_key_padding_mask
    found = check_bug(tmp_path, "classifier_batch_available_mask_not_passed", "zero-padding-attended", folder=PADDED)
    lengths = (10, 6, 8)
    assert tuple(found[0]["cell"]) == first((3, 10, 10), lambda b, q, k: q < lengths[b] <= k)
    assert '`batch["available_mask"]`' in found[0]["message"]


class Frames(nn.Module):
    """An encoder over frames that masks nothing: the mask it is handed is not its attention's."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(3, 12)

    def forward(self, feats, mask=None):
        q, k, v = self.qkv(feats).view(*feats.shape[:2], 3, 2, 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def _codes(feats, **given) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        Frames()(feats, **given)
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_zeros_without_a_mask_and_a_mask_over_samples_that_are_not_zero_are_quiet():
    feats = torch.randn(2, 6, 3) + 2.0
    feats[1, 4:] = 0.0  # row 1: two zero frames at its end
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert ("zero-padding-attended", "wrong") in _codes(feats, mask=mask)  # (the two below are quiet for a reason)
    assert not [c for c in _codes(feats) if c[0] == "zero-padding-attended"]  # zeros alone: silence, say
    real = torch.randn(2, 6, 3) + 2.0  # a mask over samples that are not zero: a pretraining mask, not padding
    assert not [c for c in _codes(real, mask=mask) if c[0] == "zero-padding-attended"]


def test_heads_of_one_packed_sequence_are_not_read_as_batch_rows(tmp_path):
    # a left-padded batch of two (zeros and attention_mask 0 at the padding) unpadded to one packed sequence, whose
    # attention is (H, Lq, Lk) einsum scores of one sequence: two heads, as many as the batch's rows, which a reading of
    # the rows as batch rows would hold to the padding of the wrong sequence
    folder = Path(__file__).parent / "data" / "chunkmerge"
    status, found, report = traced(tmp_path, "unpadded_chunks_own_causal_previous_full_merged_by_lse", False, folder)
    assert status == 0 and "zero-padding-attended" not in {f["code"] for f in found}, report
