"""Reading one position per batch row off a followed model output (trace/poolrows.py): the index a program reads it
at, `[:, -1]`, `[rows, positions]`, `gather(1, ...)`, as (rows, positions, how); and the (B, L) of an output, (B, L, D)
or each sample's (1, L) ids stacked, (B, 1, L, D)."""

from __future__ import annotations

import numpy as np
import torch

CELL = "[row, position]"  # how a one-cell read is said


def _stacked(hidden) -> int:
    """3 for a (B, L, D) output, 4 for a (B, 1, L, D) one (samples' (1, L) ids stacked), else 0."""
    return 3 if hidden.dim() == 3 else 4 if hidden.dim() == 4 and hidden.shape[1] == 1 else 0


def _lead(hidden) -> tuple:
    """(B, L) of a followed output, (B, 1, L, D) read as (B, L, D)."""
    return (hidden.shape[0], hidden.shape[2]) if hidden.dim() == 4 else tuple(hidden.shape[:2])


def _ints(index, rows: int) -> np.ndarray | None:
    """A 1-D integer index tensor of `rows` entries, as numpy."""
    if not issubclass(type(index), torch.Tensor) or index.dim() != 1 or index.shape[0] != rows \
            or index.is_floating_point() or index.dtype == torch.bool or index.device.type == "meta":
        return None
    return index.detach().cpu().numpy().astype(np.int64)


def _indexed(index, rows: int, length: int):
    """(rows, positions, how) of `output[index]` reading one position per row, or None."""
    if not isinstance(index, tuple) or len(index) < 2:
        return None
    first, second = index[0], index[1]
    if isinstance(first, slice) and first == slice(None) and isinstance(second, int) and not isinstance(second, bool) \
            and -length <= second < length:
        return np.arange(rows), np.full(rows, second % length), f"[:, {second}]"
    if len(index) == 2 and all(type(i) is int for i in index) and 0 <= first < rows and -length <= second < length:
        return np.array([first]), np.array([second % length]), CELL  # (one row at a time, in a loop)
    at, where = _ints(first, rows), _ints(second, rows)
    if at is None or where is None or ((where < -length) | (where >= length)).any() or ((at < 0) | (at >= rows)).any():
        return None
    return at, where % length, "[rows, positions]"


def _gathered(dim, index, rows: int, length: int):
    """(rows, positions, how) of `output.gather(1, index)` reading one position per row, or None."""
    if dim not in (1, -2) or not issubclass(type(index), torch.Tensor) or index.dim() != 3 or index.shape[:2] != (rows, 1):
        return None
    index = index.detach().cpu()
    if not (index == index[..., :1]).all():
        return None
    where = index[:, 0, 0].numpy().astype(np.int64)
    if ((where < 0) | (where >= length)).any():
        return None
    return np.arange(rows), where, "gather(1, ...)"
