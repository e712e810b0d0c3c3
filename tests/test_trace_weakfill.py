"""trace/weakfill.py: which writes into the scores are a mask filled with about zero (the cells against torch.tril
and the mask itself), and which are not (a real fill, a clamp, a NaN guard)."""

from __future__ import annotations

import torch

from maskcli.trace.weakfill import replaced


def _scores():
    torch.manual_seed(0)
    return torch.randn(2, 3, 5, 5)


def test_a_causal_triangle_filled_with_plus_1e_9_is_read_with_its_cells():
    s = _scores()
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    out = torch.where(keep, s, torch.ones_like(s) * 1e-9)
    x, fill, cells = replaced(torch.where, (keep, s, torch.ones_like(s) * 1e-9), {}, out)
    assert x is s and abs(fill - 1e-9) < 1e-15
    assert torch.equal(cells, (~keep).expand(2, 3, 5, 5))


def test_a_pad_row_masked_fill_with_zero_is_read():
    s = _scores()
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])[:, None, None, :]
    out = s.masked_fill(pad, 0.0)
    _, fill, cells = replaced(torch.Tensor.masked_fill, (s, pad, 0.0), {}, out)
    assert fill == 0.0 and int(cells.sum()) == 3 * 5 * 2


def test_a_large_negative_fill_a_clamp_and_a_nan_guard_are_not():
    s = _scores()
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    assert replaced(torch.where, (keep, s, torch.full_like(s, -1e9)), {}, s) is None
    high = s > 1.0  # (a mask of the scores' own values, their shape: no mask the program states)
    assert replaced(torch.where, (high, torch.full_like(s, 1.0), s), {}, s) is None
    s[0, 0, 0, :] = float("nan")
    nan = torch.isnan(s[:, :, :, :1])  # (broadcast, but the cells it replaces held no finite score)
    assert replaced(torch.where, (nan, torch.zeros_like(s), s), {}, s) is None
