"""Which cells of its map each window a window-attention block attends over holds, read off the block's own frame.

Window and grid attention (Swin's windows, MaxViT's block and grid partitions, their ports) cut a (H, W) map into
groups of gh x gw tokens, the size a field of the block states (`grid_window_size`, `grid_size`, `window_size`,
`partition_size`), and attend within each group: a block's window is gh contiguous rows by gw contiguous columns, a
grid's gh rows by gw columns spaced H / gh and W / gw apart, a shifted window's rows and columns wrapped round the
map; in each the group is gh rows by gw columns of the map. Read at an attention call under such a block: its
forward frame holds the map (4-D, channels first or last) and the groups cut from it ((B * nW, gh * gw, C) or
(B * nW, gh, gw, C), the same values moved), so each group's token is found on the map by its values (its first
channels' bytes, which must tell every cell of the map apart: a padded map's equal zeros are not read), and the groups
that are not gh rows by gw columns are kept (checks/groups.py). Bounded by MOST cells of the map.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from maskcli.trace.held import program_frames
from maskcli.trace.swinroll import _pair

FIELDS = ("grid_window_size", "grid_size", "window_size", "partition_size")
FRAMES = 6  # program frames searched for the block's forward
MOST = 1 << 15  # map cells (B * H * W) read at most
CHANNELS = 4  # channels whose bytes tell a cell apart


def window_groups(module) -> dict | None:
    """{"field", "size", "map", "windows", "tokens", "group", "rows", "cols", "cells"} of the first group of the
    block's window attention that is not size[0] rows by size[1] columns of its map; None where every group is, or
    nothing is read."""
    own = module.__dict__
    field = next((name for name in FIELDS if name in own and _pair(own[name]) is not None), None)
    if field is None:
        return None
    size = _pair(own[field])
    if size[0] * size[1] < 2:
        return None
    frame = next((f for f in program_frames(sys._getframe(1), FRAMES) if f.f_locals.get("self") is module), None)
    if frame is None:
        return None
    values = [v for v in frame.f_locals.values() if issubclass(type(v), torch.Tensor) and v.device.type != "meta"]
    maps = [v for v in values if v.dim() == 4]
    cut = [v for v in values if v.dim() in (3, 4) and (v.shape[1] == size[0] * size[1] if v.dim() == 3
                                                        else tuple(v.shape[1:3]) == size)]
    for grid in maps:
        for groups in cut:
            found = _read(grid, groups, size)
            if found is not None:
                return {"field": field, **found} if found else None
    return None


def _read(grid: torch.Tensor, groups: torch.Tensor, size: tuple[int, int]) -> dict | None:
    """The first wrong group ({} where every group is gh x gw), or None where `groups` is not cut from `grid`."""
    channels = groups.shape[-1]
    if groups.numel() != grid.numel() or channels not in (grid.shape[1], grid.shape[3]) \
            or grid.dtype != groups.dtype or not grid.is_floating_point():
        return None
    last = grid.shape[3] == channels
    cells = (grid if last else grid.permute(0, 2, 3, 1)).detach()
    b, h, w = cells.shape[:3]
    if b * h * w > MOST:
        return None
    keys = _keys(cells.reshape(-1, channels))
    order = np.argsort(keys)
    ranked = keys[order]
    if len(ranked) > 1 and (ranked[1:] == ranked[:-1]).any():
        return None  # (cells the reading cannot tell apart)
    wanted = _keys(groups.detach().reshape(-1, channels))
    at = np.clip(np.searchsorted(ranked, wanted), 0, len(ranked) - 1)
    if not (ranked[at] == wanted).all():
        return None
    where = order[at].reshape(groups.shape[0], -1)  # (groups, tokens): each token's cell, b * h * w + row * w + col
    image, row, col = where // (h * w), where // w % h, where % w
    rows, cols = _distinct(row), _distinct(col)
    good = (rows == size[0]) & (cols == size[1]) & (_distinct(image) == 1) & (_distinct(where) == where.shape[1])
    if good.all():
        return {}
    first = int(np.flatnonzero(~good)[0])
    return {"size": size, "map": (h, w), "windows": int(groups.shape[0]), "tokens": int(where.shape[1]),
            "group": first, "rows": int(rows[first]), "cols": int(cols[first]),
            "cells": [(int(r), int(c)) for r, c in zip(row[first], col[first])]}


def _keys(tokens: torch.Tensor) -> np.ndarray:
    """One bytes key per token: its first CHANNELS channels, bit for bit."""
    values = np.ascontiguousarray(tokens[:, :CHANNELS].cpu().numpy())
    return values.view(np.dtype((np.void, values.dtype.itemsize * values.shape[1]))).ravel()


def _distinct(values: np.ndarray) -> np.ndarray:
    """How many different values each row of (groups, tokens) holds."""
    ordered = np.sort(values, axis=1)
    return 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(axis=1)
