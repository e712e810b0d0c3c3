"""trace/finitefill.py: a finite fill or an additive mask in a softmax's scores, and scores that hide cells alone."""

from __future__ import annotations

import torch

from maskcli.trace.finitefill import finite_fill


def _read(scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    details = {"fill": None}
    return finite_fill(scores, torch.finfo(scores.dtype).min, details), details


def test_one_constant_is_a_fill_and_its_cells_are_masked():
    scores = torch.randn(1, 2, 4, 4)
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    masked, details = _read(scores.masked_fill(~keep, -1e9))
    assert torch.equal(masked, ~keep.expand(1, 2, 4, 4)) and details == {"fill": "finite", "fill_value": -1e9}


def test_an_additive_mask_over_ordinary_scores_is_read_by_zero_weights_and_hides_nothing_of_its_own():
    """BERT's (1 - mask) * -10000 over scores a few apart: masked exactly where the padding is (softmax's zero weights,
    checked against the padding written here), and no scores_hide."""
    scores = torch.randn(2, 2, 5, 5) * 3
    real = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    masked, details = _read(scores + (1.0 - real[:, None, None, :].float()) * -10000.0)
    assert details.get("additive") and "scores_hide" not in details
    assert torch.equal(masked, (real == 0)[:, None, None, :].expand(2, 2, 5, 5))


def test_a_row_an_additive_mask_lowers_everywhere_is_read_masked_whole():
    """t5x's `where(mask > 0, 0, -1e10)` plus a relative bias: a target padding query's row is -1e10 at every key, so
    softmax spreads its weight over all of them; read as a finite fill's row filled everywhere is, masked whole (the
    causal rows beside it by their zero weights). Reference: the causal & real-target cells written here."""
    real = torch.tensor([[1, 1, 1, 0, 0]])
    keep = torch.ones(5, 5).tril().bool()[None] & real[:, :, None].bool() & real[:, None, :].bool()
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64)  # (a relative-position bias: in float64, as t5x's example
    scores = torch.randn(1, 2, 5, 5, dtype=torch.float64) + torch.where(keep[:, None], 0.0, -1e10) + bias  # ran, the
    # masked row's scores keep it, no one constant)
    masked, details = _read(scores)
    assert details.get("additive")
    assert torch.equal(masked, ~keep[:, None].expand(1, 2, 5, 5))
    # a plane lowered at every row (an MSA's padding sequence, OpenFold's) stays shifted whole: read by zero weights
    padding = torch.randn(1, 2, 5, 5, dtype=torch.float64) - 1e10
    masked, _ = _read(torch.cat([scores, padding]))
    assert torch.equal(masked[0], ~keep[0, None].expand(2, 5, 5)) and not masked[1].any()


def test_scores_far_apart_hide_cells_of_their_own():
    """Scores ±1e5 apart: softmax zeroes real cells no mask lowered (a cell whose own score is above any fill), said as
    scores_hide with the largest score's magnitude; the cells read are still softmax's zero weights."""
    scores = torch.tensor([[[[0.0, 1e5, -2e4, 5.0], [3e4, 0.0, -1e4, 2.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]]])
    masked, details = _read(scores + torch.tensor([0.0, 0.0, 0.0, -10000.0]))
    assert details.get("additive") and details["scores_hide"] == 1e5
    assert torch.equal(masked, torch.softmax(scores + torch.tensor([0.0, 0.0, 0.0, -10000.0]), -1) == 0)


def test_a_round_fill_nearer_zero_is_a_fill_where_softmax_zeroes_its_cells():
    """icefall's Zipformer masks with masked_fill(mask, -1000.0): a whole number above -1e4, each cell weight exactly 0
    beside ordinary scores (a row filled whole keeps the reading); the cells read are the mask's, by a loop."""
    scores = torch.randn(2, 1, 5, 5)
    lengths = [5, 3]
    hide = torch.tensor([[[[k >= lengths[b] or abs(q - k) > 2 for k in range(5)] for q in range(5)]] for b in range(2)])
    hide[1, 0, 4] = True  # (a query row filled whole)
    masked, details = _read(scores.masked_fill(hide, -1000.0))
    assert torch.equal(masked, hide) and details == {"fill": "finite", "fill_value": -1000.0}


def test_a_least_score_that_is_no_round_fill_or_leaves_weight_is_no_fill():
    scores = torch.randn(1, 1, 4, 4)
    for low in (-150.5, -50.0):  # (not a whole number; a whole number whose cells keep some weight, e^-50 > 0)
        masked, details = _read(scores.masked_fill(torch.eye(4, dtype=torch.bool), low))
        assert not masked.any() and details == {"fill": None}, low
    one = scores.clone()
    one[0, 0, 0, 1] = -1000.0  # (one cell alone: no mask's)
    assert not _read(one)[0].any()
