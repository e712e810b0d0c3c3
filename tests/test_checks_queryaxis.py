"""checks/queryaxis.py: a self-attention's padding laid on the query axis, caught in the published bug's reproduction
(tests/data/bugs) and in a program written another way (tests/data/queryaxis), quiet on the fixes, on a mask over both
axes and on a cross-attention whose queries' own padding hides its rows; the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import maskcli
from checkbugs import check_bug, first
from maskcli.checks.registry import severity

QUERYAXIS = Path(__file__).parent / "data" / "queryaxis"


def test_pix2struct_vision_mask_broadcast_over_the_queries_is_found(tmp_path):
    # huggingface/transformers#23974: attention_mask[:, None, :, None]; 5 and 3 real patches of 6, right-padded
    pytest.importorskip("transformers")  # (its Pix2StructVisionConfig: the hf extra)
    found = check_bug(tmp_path, "pix2struct_vision_attention_mask_broadcast_query_axis", "padding-on-queries")
    real = (5, 3)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: q < real[b] and k >= real[b])
    assert "query axis" in found[0]["message"]


def test_a_left_padded_key_padding_mask_unsqueezed_onto_the_queries_is_found(tmp_path):
    # written otherwise: left-padded, True = padding, an additive finfo.min bias handed to SDPA
    found = check_bug(tmp_path, "left_padded_sdpa_pad_mask_on_query_axis", "padding-on-queries", folder=QUERYAXIS)
    pads = (0, 2)
    assert tuple(found[0]["cell"]) == first((2, 4, 4), lambda b, q, k: q >= pads[b] and k < pads[b])


def test_magpietts_query_mask_laid_on_the_query_axis_is_found(tmp_path):
    # NVIDIA-NeMo/Speech#14836: MagpieTTS's SelfAttention built query_mask[:, None, :, None]; handed as `query_mask`
    # (a token mask whose polarity its name does not say), 12 and 7 real tokens of 12, right-padded, non-causal
    found = check_bug(tmp_path, "nemo_magpietts_transformer_self_attention_query_only_padding_mask", "padding-on-queries")
    real = (12, 7)
    assert tuple(found[0]["cell"]) == first((2, 12, 12), lambda b, q, k: q < real[b] and k >= real[b])


def test_a_vits_style_x_mask_unsqueezed_onto_the_queries_is_found(tmp_path):
    # written otherwise: VITS's channels-first encoder, a (B, 1, T) `x_mask` of floats, left-padded, a -1e4 fill
    found = check_bug(tmp_path, "vits_style_x_mask_unsqueezed_on_query_axis", "padding-on-queries", folder=QUERYAXIS)
    pads = (4, 0)
    assert tuple(found[0]["cell"]) == first((2, 9, 9), lambda b, q, k: q >= pads[b] and k < pads[b])


def _codes(run) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        run()
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def _attend(q, k, v, hidden):
    scores = (q @ k.transpose(-1, -2)).masked_fill(hidden, torch.finfo(q.dtype).min)
    return scores.softmax(-1) @ v


def test_a_mask_over_both_axes_and_a_cross_attention_over_its_queries_padding_are_quiet():
    # (the padding held by the function that runs attention, as trace/held.py reads it: an argument by name)
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    x = torch.randn(2, 2, 4, 8)

    def both(attention_mask=attention_mask):  # an outer product of the padding: padded rows see nothing, real rows see no pad
        real = attention_mask.bool()
        _attend(x, x, x, ~(real[:, None, :, None] & real[:, None, None, :]))

    memory = torch.randn(2, 2, 4, 8)

    def crossing(encoder_hidden_states=memory, attention_mask=attention_mask):  # a decoder's padded query rows over an unpadded memory of 4
        _attend(x, encoder_hidden_states, encoder_hidden_states, (attention_mask == 0)[:, None, :, None])

    def only_queries(attention_mask=attention_mask):  # the same self-attention with the query axis alone: found (the two above are not for no reason)
        _attend(x, x, x, (attention_mask == 0)[:, None, :, None])

    def named_both(x_mask=attention_mask):  # a token mask under a name that says no polarity, over both axes: quiet
        real = x_mask.bool()
        _attend(x, x, x, ~(real[:, None, :, None] & real[:, None, None, :]))

    def named_keys(x_mask=attention_mask):  # the same mask laid on the keys alone: padded rows see the real keys, quiet
        _attend(x, x, x, (x_mask == 0)[:, None, None, :])

    assert ("padding-on-queries", "wrong") in _codes(only_queries)
    for run in (both, crossing, named_both, named_keys):
        assert not [c for c in _codes(run) if c[0] == "padding-on-queries"]
