"""Which window offsets a window-attention module's relative-position index sends to one row of its bias table.

Swin's WindowAttention and its ports (nnFormer's and Video Swin's 3-D windows, MaxViT's, Uformer's) hold a bias table
of one row per offset between two tokens of a window, prod(2 * w - 1) rows for a window of sides w, and a
`relative_position_index` (N, N), N = prod(w), that says which row each pair of tokens reads. Read once per module
(and index tensor) at an attention call made under it: the window's tokens in row-major order, each pair's offset,
and the rows the index uses. Where the table has a row for every offset and the index uses fewer rows than there are
offsets, two different offsets share one bias (nnFormer#88: 3-D strides (3 * Wh - 1, 2 * Wh - 1, 1)); checks/relindex.py
says it. Token orders other than row-major are read alike (only how many rows are used is asked); an index over more
tokens than the window's (a class token's extra rows, BEiT's) is not read.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

MOST = 1 << 16  # index cells read at most
_DONE: dict = {}  # id(index) -> (a weak reference to it, (its version, rows, window), the reading)


def _window(value) -> tuple[int, ...] | None:
    if type(value) is int:
        return value, value
    if type(value) in (list, tuple) and len(value) in (2, 3) and all(type(x) is int and x > 0 for x in value):
        return tuple(int(x) for x in value)
    return None


def collisions(module) -> dict | None:
    """{"window", "rows", "offsets", "used", "row", "pairs", "apart"} where the module's relative_position_index sends
    two different offsets of its window to one row of a table sized one row per offset; None otherwise."""
    buffers, parameters = module.__dict__.get("_buffers") or {}, module.__dict__.get("_parameters") or {}
    index = buffers.get("relative_position_index", module.__dict__.get("relative_position_index"))
    table = parameters.get("relative_position_bias_table")
    window = _window(module.__dict__.get("window_size"))
    if not issubclass(type(index), torch.Tensor) or not issubclass(type(table), torch.Tensor) or window is None:
        return None
    key = (index._version, int(table.shape[0]), window)
    held = _DONE.get(id(index))
    if held is None or held[0]() is not index or held[1] != key:  # (an id reused by another tensor: read anew)
        if len(_DONE) > 256:
            _DONE.clear()
        held = _DONE[id(index)] = (weakref.ref(index), key, _read(index, key[1], window))
    return held[2]


def _read(index: torch.Tensor, rows: int, window: tuple[int, ...]) -> dict | None:
    tokens, offsets = math.prod(window), math.prod(2 * w - 1 for w in window)
    if index.numel() != tokens * tokens or index.numel() > MOST or rows < offsets or index.is_floating_point():
        return None
    cells = index.detach().cpu().reshape(tokens, tokens).numpy().astype(np.int64)
    used = np.unique(cells)
    if len(used) >= offsets:
        return None
    coords = np.stack(np.meshgrid(*[np.arange(w) for w in window], indexing="ij")).reshape(len(window), -1).T
    apart = coords[:, None, :] - coords[None, :, :]  # (N, N, d): the query's cell less the key's
    code = np.ravel_multi_index(tuple(np.moveaxis(apart + np.array(window) - 1, -1, 0)), [2 * w - 1 for w in window])
    pairs = np.unique(np.stack([cells.ravel(), code.ravel()], axis=1), axis=0)
    shared = pairs[1:, 0][pairs[1:, 0] == pairs[:-1, 0]]
    if not len(shared):  # (fewer rows used than offsets, yet no row with two: an order this reading does not see)
        return None
    row = int(shared[0])
    codes = pairs[pairs[:, 0] == row, 1][:2]
    at = [np.argwhere((cells == row) & (code == c))[0] for c in codes]
    return {"window": window, "rows": rows, "offsets": offsets, "used": int(len(used)), "row": row,
            "pairs": [tuple(int(x) for x in a) for a in at],
            "apart": [tuple(int(x) for x in apart[a[0], a[1]]) for a in at]}
