"""checks/offgrid.py: rope positions a frame computes off the integer grid (a shift with `/` for `//`); against
Python's own integer and true division."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace.offgrid import _off_grid

OFFGRID = Path(__file__).parent / "data" / "offgrid"


def test_longlm_selfextend_group_query_position_true_division(tmp_path):
    """datamllab/LongLM 715c1e3 (written blind, batch blind-ec): SelfExtend's grouped query position
    `q // g1 + g2 - g2 / g1` with g1 = 5, g2 = 8 puts every grouped query 0.4 off a token's place, in prefill and in
    cached decode; the fix's `g2 // g1` keeps them integers."""
    [hit] = check_bug(tmp_path, "longlm_selfextend_group_query_position_true_division", "positions-off-grid")
    assert "`group_query_position` (6.4, 6.4," in hit["message"] and "integer positions `position_ids`" in hit["message"]
    assert round((8 - 8 / 5) % 1, 4) == 0.4 and (8 - 8 // 5) % 1 == 0  # the shift, by true and by floor division


def test_selfextend_padded_batch_group_shift_written_another_way(tmp_path):
    """The same bug in a plain-torch block over a left-padded batch (positions from the mask's cumsum, `group_pos`):
    window 6, group 4 puts the grouped queries 0.5 off the grid."""
    [hit] = check_bug(tmp_path, "selfextend_padded_eager_group_shift", "positions-off-grid", OFFGRID)
    assert f"every one {(6 - 6 / 4) % 1:g} off the integer grid" in hit["message"]


def test_interpolated_lone_and_integer_positions_are_quiet():
    """Position interpolation (every position one scaling of the integer ones), a lone decode position and integer
    positions are not read as off the grid; a constant fractional shift is."""
    positions = torch.arange(12).view(1, -1)
    stated = [("position_ids", positions)]
    assert _off_grid(positions / 4, stated) is None
    assert _off_grid(torch.tensor([[21 / 4]]), [("position_ids", torch.tensor([[21]]))]) is None
    assert _off_grid((positions // 4 + 2).float(), stated) is None
    found = _off_grid(positions // 4 + 2.5, stated)
    assert found is not None and found["fraction"] == 0.5 and found["integer"] == "position_ids"
