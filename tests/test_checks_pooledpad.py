"""checks/pooledpad.py (and trace/poolweights.py, which keeps the positions each attention pooling weighs): a pooling
softmax that gives weight to positions the model call states are padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkbugs import BUGS, check_bug, traced
from maskcli.trace.capture import Trace

POOLEDPAD = Path(__file__).parent / "data" / "pooledpad"


def test_prokbert_sequence_classification_pooling_softmax_over_padding(tmp_path):
    """nbrg-ppcu/prokbert PR #109 (commit bed3693; written blind, batch blind-dv): ProkBertForSequenceClassification
    pools with softmax(weighting_layer(h), dim=1) over every position, then sum(weights * h, dim=1); the fix fills the
    scores at attention_mask == 0 with -inf first."""
    [hit] = check_bug(tmp_path, "prokbert_sequence_classification_attention_pooling_ignores_padding",
                      "pooled-over-padding")
    # the program's own batch: a 22-token segment and an 11-token one padded to 22: row 1's pads are 11..21
    long_len, short_len = 1 + 20 + 1, 1 + 9 + 1
    assert tuple(hit["cell"]) == (1, 0, short_len)
    assert f"({long_len - short_len} such positions)" in " ".join(hit["message"].split())


def test_left_padded_classifier_pooled_by_bmm(tmp_path):
    """Written another way: a plain-PyTorch classifier over a left-padded batch (lengths 12, 7, 9), its `padding_mask`
    True on the pads, the (B, L) scores softmaxed and pooled by torch.bmm(alpha.unsqueeze(1), h)."""
    [hit] = check_bug(tmp_path, "transformer_classifier_left_padded_bmm_pooling_over_pads", "pooled-over-padding",
                      POOLEDPAD)
    lengths, width = (12, 7, 9), 12
    pads = sum(width - n for n in lengths)  # (left padding: row b's pads are 0 .. width - n - 1)
    assert tuple(hit["cell"]) == (1, 0, 0)
    assert f"({pads} such positions)" in " ".join(hit["message"].split())
    assert "padding_mask" in hit["message"]


def test_masked_poolings_are_quiet(tmp_path):
    """AllenNLP's masked_softmax (times the mask, renormalised), a multi-head pooling filled with -inf at the pads
    before its softmax and pooled by an einsum, an unpadded batch pooled by sum(weights * h): no finding."""
    status, found, report = traced(tmp_path, "masked_poolings_correct", False, POOLEDPAD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def _pools(pool) -> tuple:
    """What trace/poolweights.py kept of the poolings `pool` made inside one outermost module call."""
    class Model(torch.nn.Module):
        def forward(self, h):
            q = h[:, None]
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            return pool(h)

    with Trace() as t:
        Model()(torch.randn(2, 5, 4))
    return t.tops[0].pools


@pytest.mark.parametrize("form", ["mul", "rmul", "bmm", "einsum", "einsum_heads"])
def test_the_positions_weighed_against_a_loop(form):
    """Each way a pooling applies its weights keeps, per batch row, the positions given a weight above 1e-6 (by any
    query), read against a loop over the weights; row 1's last two scores filled with -inf weigh nothing."""
    scores = torch.randn(2, 3, 5)
    scores[1, :, 3:] = float("-inf")

    def pool(h):
        if form in ("mul", "rmul"):
            w = torch.softmax(scores[:, 0, :, None], dim=1)  # (2, 5, 1)
            return torch.sum(w * h if form == "mul" else h * w, dim=1)
        if form == "bmm":
            return torch.bmm(torch.softmax(scores[:, 0], dim=-1).unsqueeze(1), h)
        if form == "einsum":
            return torch.einsum("bl,bld->bd", torch.softmax(scores[:, 0], dim=1), h)
        return torch.einsum("bhl,bld->bhd", scores.softmax(dim=-1), h)

    [kept] = _pools(pool)
    heads = 3 if form == "einsum_heads" else 1
    expected = [[any(torch.softmax(scores[b, q], dim=0)[k] > 1e-6 for q in range(heads)) for k in range(5)]
                for b in range(2)]
    assert kept["weighed"].tolist() == expected
    assert expected[1] == [True, True, True, False, False]


def test_weights_times_a_mask_or_renormalised_are_no_pooling():
    """A softmax's weights times a 0/1 mask of their own shape weigh no values; what is renormalised after is no
    softmax's result; a softmax over the batch axis pools no positions: nothing kept."""
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])

    def pool(h):
        w = torch.softmax(torch.randn(2, 5), dim=-1) * mask
        w = w / w.sum(-1, keepdim=True)
        first = torch.einsum("bl,bld->bd", w, h)
        return first + torch.einsum("bl,bld->ld", torch.softmax(torch.randn(2, 5), dim=0), h).sum()

    assert _pools(pool) == ()


def test_csums2_esa_spec_pooling_mask_polarity_turned_round(tmp_path):
    """tingxiecsu/CSU-MS2#4 (fixed in commit 0f37fc7; written blind, batch blind-ee): ESA_SPEC fills and zeroes its
    per-channel pooling weights where `mask == 0`, the mask being `~(arange < num_peaks)` (True = padded peak), the
    one its peak attention is handed as `src_key_padding_mask`: it pools the padded peaks only. Both versions also
    add that bool mask to the attention scores (`attn += attn_mask`, another bug reproduced elsewhere): bool-added and
    padding-unused are true findings of it on either run, so the fix is held to no pooled-over-padding."""
    name = "csums2_esa_spec_peak_padding_mask_polarity_inverted"
    status, found, report = traced(tmp_path, name, False)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "pooled-over-padding" and f["severity"] == "wrong"]
    # the program's own batch: 12, 7 and 4 peaks padded to 12; row 1's pads are 7..11, row 2's 4..11
    assert tuple(hit["cell"]) == (1, 0, 7)
    assert f"({(12 - 7) + (12 - 4)} such positions)" in " ".join(hit["message"].split())
    assert "polarity turned round" in " ".join(hit["message"].split())
    status, found, report = traced(tmp_path, name, True)
    assert [f["code"] for f in found if f["code"] == "pooled-over-padding"] == [], report
    assert {f["code"] for f in found if f["severity"] == "wrong"} <= {"bool-added", "padding-unused"}, report


def test_left_padded_set_readout_mask_turned_round(tmp_path):
    """Written another way: a set encoder (torch's nn.TransformerEncoder handed `padding_mask`, True = padding, left
    padded to counts 9, 5, 7) whose attention readout, one score per atom filled by torch.where and pooled by bmm,
    reads that mask as a keep mask: only the pads are pooled."""
    [hit] = check_bug(tmp_path, "set_readout_left_padded_pool_mask_turned_round", "pooled-over-padding", POOLEDPAD)
    counts, width = (9, 5, 7), 9
    assert tuple(hit["cell"]) == (1, 0, 0)  # (left padding: row b's pads are 0 .. width - count - 1)
    assert f"({sum(width - c for c in counts)} such positions)" in " ".join(hit["message"].split())
    assert "padding_mask" in hit["message"] and "polarity turned round" in " ".join(hit["message"].split())


def test_per_feature_weights_filled_after_the_softmax_against_a_loop():
    """Weights of one softmax per feature (B, L, C), zeroed at some positions by a masked_fill after the softmax, times
    values of their own shape: the positions kept are those some feature gives a weight above 1e-6, by a loop."""
    scores, hidden = torch.randn(2, 5, 3), torch.zeros(2, 5, 1, dtype=torch.bool)
    hidden[0, 4], hidden[1, 2:] = True, True

    def pool(h):
        w = torch.softmax(scores, dim=1).masked_fill(hidden, 0)
        return torch.sum(w * torch.cat([h, h], -1)[..., :3], dim=1)

    [kept] = _pools(pool)
    expected = [[any(not hidden[b, k, 0] and torch.softmax(scores[b, :, c], dim=0)[k] > 1e-6 for c in range(3))
                 for k in range(5)] for b in range(2)]
    assert kept["weighed"].tolist() == expected
    assert expected == [[True] * 4 + [False], [True, True, False, False, False]]


def test_s3prl_attentive_pooling_adds_its_bool_length_mask_to_the_logits(tmp_path):
    # s3prl/s3prl#579 (written blind, batch blind-gs; the proposed fix): AttentivePooling adds `len_masks`, True
    # on each utterance's real frames, to its logits (+1 and +0), so the pads keep their weight; the fix adds -1e9 where
    # it is False. The expert runs after the upstream, in no model call: the lengths its frames hold (`features_len`,
    # 159, 69 and 109 frames) say the padding. Row 1's pads are 69 .. 158, row 2's 109 .. 158
    [hit] = check_bug(tmp_path, "s3prl_attentive_pooling_bool_len_mask_added_to_logits", "pooled-over-padding")
    message = " ".join(hit["message"].split())
    assert tuple(hit["cell"]) == (1, 0, 69) and f"({(159 - 69) + (159 - 109)} such positions)" in message
    assert "features_len in forward()" in message


def test_a_pooling_head_handed_lengths_it_never_masks_with(tmp_path):
    """Written another way: an upstream nn.TransformerEncoder over a right-padded batch (10, 6, 3 frames of 10), then a
    self-attention pooling head called on its own with `frame_lens`, its weights never masked; the fix fills -inf."""
    [hit] = check_bug(tmp_path, "separate_pooling_head_lengths_held_mask_never_applied", "pooled-over-padding",
                      POOLEDPAD)
    assert tuple(hit["cell"]) == (1, 0, 6) and "((10 - 6) + (10 - 3))" not in hit["message"]
    assert f"({(10 - 6) + (10 - 3)} such positions)" in " ".join(hit["message"].split())


def test_one_requests_heads_pooled_beside_every_requests_lengths_are_quiet(tmp_path):
    """Written here after LightLLM's decode (blind-pv's fix, a false alarm before): a loop over the requests softmaxes
    each one's (heads, n) scores over its own n cached tokens; `b_seq_len` (6, 4) held beside it counts requests, not
    the heads the pooled rows are, so no row of it is padding."""
    status, found, report = traced(tmp_path, "decode_loop_pools_each_requests_heads", False, POOLEDPAD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_espnet_location_aware_attention_over_padded_encoder_frames(tmp_path):
    """espnet/espnet#397 (written blind, blind-vs; missed before): AttLoc scored every frame of the padded encoder batch
    with a tanh MLP (no q @ kᵀ) and softmaxed over all of them; the weights pool `enc_h * w.view(B, T, 1)`. A pooling
    of one query a row, in a model call that attends by no other call, over rows the frames' `enc_hs_len` lies over, is
    recorded as a call (trace/poolweights.attended): row 1 (5 of 10 frames) weighs its padding. The fix (masked_fill
    with -inf) quiet, its call named key padding."""
    found = check_bug(tmp_path, "espnet_rnn_attloc_padded_encoder_frames_in_softmax", "pooled-over-padding")
    lengths = [10, 5]
    first_pad = next((b, k) for b in range(2) for k in range(10) if k >= lengths[b])  # the reference: a plain loop
    assert tuple(found[0]["cell"]) == (first_pad[0], 0, first_pad[1])
    status, _, report = traced(tmp_path, "espnet_rnn_attloc_padded_encoder_frames_in_softmax", True, BUGS)
    assert "(2,1,1,10)  padding (--lengths 10,5)" in report


def test_a_bahdanau_decoder_whose_source_mask_is_never_applied_is_found(tmp_path):
    """Written another way: the PyTorch seq2seq tutorial's additive attention (`v^T tanh(W [s; h])`) over a
    right-padded source, `make_src_mask` built and handed to the attention, never filled in. Its calls (one query a
    row over 7 source positions) are a cross-attention that sees every key: named full, not a causal decode step. The
    fix (masked_fill(mask == 0, -1e10)) quiet."""
    found = check_bug(tmp_path, "bahdanau_gru_decoder_src_mask_never_applied", "pooled-over-padding", POOLEDPAD)
    assert tuple(found[0]["cell"]) == (1, 0, 4)  # (row 1 holds 4 tokens of 7: position 4 its first pad)
    _, _, report = traced(tmp_path, "bahdanau_gru_decoder_src_mask_never_applied", False, POOLEDPAD)
    assert "(3,1,1,7)  full" in report
