"""checks/askedcausal.py: a module that takes causality as a word of each call runs causal where the word was not
handed; against the masks written out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, traced

ASKED = Path(__file__).parent / "data" / "askedcausal"


def test_maxjcohen_local_map_mask_device_in_the_mask_future_slot(tmp_path):
    """maxjcohen/transformer 60df0da (written blind, batch blind-cm): MultiHeadAttention called
    `generate_local_map_mask(K, attention_size, self._scores.device)`, the device landing in `mask_future` (truthy),
    so the encoder's symmetric window (and the cross-attention's) became causal, though only the decoder's
    self-attention is handed mask="subsequent"; the fix passes mask_future=False by keyword."""
    [hit] = check_bug(tmp_path, "maxjcohen_transformer_local_map_mask_device_passed_as_mask_future", "causal-unasked")
    assert hit["message"].startswith("layers_encoding.0._selfAttention") and "mask='subsequent'" in hit["message"]
    # the reference: the project's local map, |i - j| > 3 masked, against its mask_future branch
    i, j = np.indices((16, 16))
    symmetric, future = np.abs(i - j) > 3, (i - j > 3) ^ (j - i > 0)
    assert not symmetric[j > i].all() and future[j > i].all()


def test_mask_type_tested_with_an_or_that_is_always_true(tmp_path):
    """Written another way (tests/data/askedcausal): an encoder-decoder on SDPA over right-padded series whose attention
    tests `mask_type == "causal" or "future"` (always true): the encoder runs causal though only the decoder's
    self-attention says mask_type="causal"; the fix's `in` is quiet (the encoder sees its later real steps)."""
    [hit] = check_bug(tmp_path, "seq_encdec_mask_type_or_always_true", "causal-unasked", ASKED)
    assert hit["message"].startswith("enc:") and "mask_type=None" in hit["message"]
    _, found, _ = traced(tmp_path, "seq_encdec_mask_type_or_always_true", True, ASKED)
    assert not [f for f in found if f["code"] == "causal-unasked"]
    mask_type = None  # the reference: Python's `or` against `in`, then SDPA under each mask
    assert bool(mask_type == "causal" or "future") and mask_type not in ("causal", "future")
    import torch

    q, eye = torch.randn(1, 1, 4, 8), torch.eye(4)[None, None]
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    weights = [torch.nn.functional.scaled_dot_product_attention(q, q, eye, attn_mask=m) for m in (tril, ~tril | tril)]
    assert weights[0][0, 0][~tril].max() == 0 and weights[1][0, 0][~tril].min() > 0
