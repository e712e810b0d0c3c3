"""checks/groups.py (and trace/groups.py): a window or grid attention whose groups are not the gh x gw cells of the map
its block states, against each group's cells worked out here by loops over the partitions' index arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.trace.groups import _read

GROUPS = Path(__file__).parent / "data" / "groups"


def first_group_cells(groups: list[list[tuple[int, int]]]) -> str:
    """The message's cells of group 0, as the finding writes them (at most 8)."""
    return ", ".join(f"({r}, {c})" for r, c in groups[0][:8])


def test_maxvit_grid_partition_viewed_as_blocks(tmp_path):
    """ChristophReich1996/MaxViT#2 (commits 08be6f4, c033d09): view(B, C, H // g, g, W // g, g) then
    permute(0, 3, 5, 2, 4, 1): group 0 of an 8x8 map, g = 2, is row 0 at columns 0, 2, 4, 6, by the loop below over
    the view's axes (i, j outer in the permute, then a, b: row a * g + i, column b * g + j)."""
    g, h, w = 2, 8, 8
    order = [(a * g + i, b * g + j) for i in range(g) for j in range(g) for a in range(h // g) for b in range(w // g)]
    groups = [order[n:n + g * g] for n in range(0, len(order), g * g)]
    [hit] = {f["message"]: f for f in check_bug(tmp_path, "maxvit_reich_grid_partition_is_block_partition",
                                                 "window-group-shape")}.values()
    assert f"group 0 holds cells {first_group_cells(groups)} (row, column)" in hit["message"], hit
    assert "grid_window_size=(2, 2)" in hit["message"] and "1 rows by 4 columns" in hit["message"]


def test_a_grid_permute_copied_from_the_window_partition(tmp_path):
    """Written another way: channels last, `partition_size`, an 8x12 map, SDPA; the grid view (B, g, H // g, g, W // g,
    C) permuted (0, 1, 3, 2, 4, 5): group 0 is row 0, columns 0-3, by the loop; the fix is quiet."""
    g, h, w = 2, 8, 12
    order = [(i * (h // g) + a, j * (w // g) + b) for i in range(g) for j in range(g)
             for a in range(h // g) for b in range(w // g)]
    groups = [order[n:n + g * g] for n in range(0, len(order), g * g)]
    [hit] = check_bug(tmp_path, "grid_partition_window_permute_channels_last", "window-group-shape", GROUPS)
    assert f"group 0 holds cells {first_group_cells(groups)} (row, column)" in hit["message"], hit


def test_windows_grids_and_shifted_windows_of_the_stated_size_are_read_as_right():
    """Swin's windows, MaxViT's grid and a shifted map's windows (rows and columns wrapped round) are 2 rows by 2
    columns, channels first or last: nothing; a map whose cells repeat (zero padding) is not read; groups of another
    map are not read."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 16)
    g = 2
    window = x.view(2, 4, g, 6, g, 16).permute(0, 1, 3, 2, 4, 5).reshape(-1, g * g, 16)
    grid = x.view(2, g, 4, g, 6, 16).permute(0, 2, 4, 1, 3, 5).reshape(-1, g * g, 16)
    rolled = torch.roll(x, (-1, -1), (1, 2)).view(2, 4, g, 6, g, 16).permute(0, 1, 3, 2, 4, 5).reshape(-1, g * g, 16)
    for groups in (window, grid, rolled):
        assert _read(x, groups, (g, g)) == {}
        assert _read(x.permute(0, 3, 1, 2).contiguous(), groups, (g, g)) == {}
    rows = x.reshape(-1, g * g, 16)  # (runs of 4 tokens of one row)
    found = _read(x, rows, (g, g))
    assert (found["rows"], found["cols"], found["cells"]) == (1, 4, [(0, 0), (0, 1), (0, 2), (0, 3)])
    padded = x.clone()
    padded[:, -1] = 0
    assert _read(padded, padded.reshape(-1, g * g, 16), (g, g)) is None
    assert _read(torch.randn(2, 8, 12, 16), window, (g, g)) is None
    assert np.array_equal(np.array(found["cells"])[:, 0], np.zeros(4))
