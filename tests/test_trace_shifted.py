"""trace/shifted.py: score rows filled low in every cell, then shifted by their row max, against a loop over rows."""

from __future__ import annotations

import torch

from maskcli.trace.shifted import filled_rows


def test_rows_filled_whole_are_found_and_rows_filled_in_part_are_not():
    scores = torch.randn(2, 3, 4, 5)
    scores[0, 1, 2] = -1e9  # one row filled whole
    scores[1, 0, 3, :2] = torch.finfo(scores.dtype).min  # a row filled in part
    out = scores - scores.amax(dim=-1, keepdim=True)
    rows = filled_rows(torch.Tensor.__sub__, (scores, scores.amax(dim=-1, keepdim=True)), scores, out)
    expected = torch.zeros(2, 3, 4, dtype=torch.bool)
    for b in range(2):
        for h in range(3):
            for q in range(4):
                expected[b, h, q] = all(float(scores[b, h, q, k]) <= -1e4 for k in range(5))
    assert torch.equal(rows, expected)


def test_a_subtraction_of_another_shape_is_not_read():
    scores = torch.full((2, 4, 4), -1e9)
    assert filled_rows(torch.Tensor.__sub__, (scores, scores), scores, scores - scores) is None
