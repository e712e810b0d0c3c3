"""trace/undone.py: a low fill lifted back by a bounded map of the scores, against cells written by hand."""

from __future__ import annotations

import torch

from maskcli.trace.undone import lifted, near_real


def _filled():
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 3, 4)
    pad = torch.tensor([False, False, True, True])
    scores = scores.masked_fill(pad, float("-inf"))
    scores[0, 1, 2] = float("-inf")  # a row filled whole
    return scores, pad


def test_tanh_after_an_inf_fill_is_noted_with_the_cells_it_lifted():
    scores, pad = _filled()
    out = torch.tanh(scores)
    weak = {}
    lifted(weak, torch.tanh, scores, out)
    value, cells, undone = weak[id(out)]
    expected = torch.zeros(1, 2, 3, 4, dtype=torch.bool)
    for h in range(2):
        for q in range(3):
            if (h, q) != (1, 2):
                for k in (2, 3):
                    expected[0, h, q, k] = True
    assert value == -1.0 and torch.equal(cells, expected) and undone == {"fill": float("-inf"), "by": "tanh"}


def test_a_clamp_that_keeps_the_fill_low_and_a_map_that_meets_no_fill_are_not_noted():
    scores, _ = _filled()
    weak = {}
    lifted(weak, torch.clamp, scores, torch.clamp(scores, min=-1e4))
    plain = torch.randn(1, 2, 3, 4)
    lifted(weak, torch.tanh, plain, torch.tanh(plain))
    lifted(weak, torch.exp, scores, torch.exp(scores))  # (no bounded map)
    assert weak == {}


def test_near_real_keeps_the_lifted_cells_within_ten_of_the_rows_largest_real_score():
    x = torch.tensor([[2.0, 0.0, -5.0, -50.0]])
    cells = torch.tensor([[False, False, True, True]])
    assert near_real(x, cells).tolist() == [[False, False, True, False]]
