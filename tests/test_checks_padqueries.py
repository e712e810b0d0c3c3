"""checks/padqueries.py: a key padding mask that calls padding the call's own queries; against nn.MultiheadAttention."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug

PADQUERIES = Path(__file__).parent / "data" / "padqueries"


def _weights_on(key_padding_mask: torch.Tensor, start: int) -> torch.Tensor:
    """nn.MultiheadAttention's own weights, queries x[:, start:] over keys x, under `key_padding_mask`."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(key_padding_mask.shape[0], key_padding_mask.shape[1], 8)
    return mha(x[:, start:], x, x, key_padding_mask=key_padding_mask)[1]


def test_gluonts_tft_observed_values_handed_as_key_padding_mask(tmp_path):
    """awslabs/gluonts 8e2e909 (PR #2536, written blind, batch blind-cm): TFT's decoder hands `past_observed_values`
    (1 = observed) and the forecast steps' ones as key_padding_mask (True = ignore), so the forecast steps (the queries,
    x[:, T:]) attend only the missing past steps; the fix passes `1 - observed`. Against MHA: under the buggy mask a
    query gives its own step and every observed step weight 0."""
    [hit] = check_bug(tmp_path, "gluonts_torch_tft_decoder_key_padding_mask_observed_inverted", "queries-called-padding")
    assert "keys 12-15, this call's own queries" in hit["message"]
    observed = torch.ones(2, 6)
    observed[:, 0] = 0
    weights = _weights_on(torch.cat([observed, torch.ones(2, 2)], 1).bool(), 6)  # (B, 2 queries, 8 keys)
    assert weights[:, :, 1:].abs().max() == 0 and torch.allclose(weights[:, :, 0], torch.ones(2, 2))


def test_last_click_keep_mask_handed_as_key_padding(tmp_path):
    """Written another way (tests/data/padqueries): a sequence-first MHA over left-padded histories whose last click
    alone queries, handed `ids != 0` (True = real) as key_padding_mask: the last click attends only the padding; the fix
    `ids == 0` is quiet."""
    [hit] = check_bug(tmp_path, "next_item_last_query_keep_mask_as_key_padding", "queries-called-padding", PADQUERIES)
    assert "key 7, this call's own query" in hit["message"]
    ids = torch.tensor([[0, 0, 5, 9], [0, 3, 8, 2]])
    weights = _weights_on(ids != 0, 3)
    assert weights[:, 0, 3].max() == 0 and weights[:, 0, ids[0] == 0].sum() > 0.99
