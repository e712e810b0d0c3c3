"""trace/shifted.py: score rows filled low in every cell, then shifted by their row max, against a loop over rows."""

from __future__ import annotations

import numpy as np
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


def test_a_softmax_of_rows_filled_whole_then_shifted_reads_them_as_seeing_no_key():
    """flamingo-mini's MaskedCrossAttention: -max where masked, `sim - sim.amax(-1, keepdim=True)`, then `sim.softmax`:
    the rows filled whole are the rows that see no key, as a loop over the mask says, and the fill is a finite one."""
    from maskcli.checks.context import keep
    from maskcli.trace.capture import Trace

    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 3, 8)
    allowed = torch.rand(2, 1, 6, 3) > 0.4
    allowed[0, 0, 1] = False  # a row with no key
    allowed[1, 0, 4] = False
    with Trace() as t:
        sim = torch.einsum("bhid,bhjd->bhij", q, k).masked_fill(~allowed, -torch.finfo(torch.float32).max)
        (sim - sim.amax(dim=-1, keepdim=True).detach()).softmax(dim=-1)
    [call] = t.calls
    expected = [[[any(bool(allowed[b, 0, i, j]) for j in range(3)) for i in range(6)] for h in range(4)] for b in range(2)]
    assert np.broadcast_to(keep(call), (2, 4, 6, 3)).any(axis=-1).tolist() == expected
    assert call.details["fill"] in ("min", "finite")
