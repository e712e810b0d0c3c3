"""Keys a program zeroed in K alone: its own statement of which keys are padding (checks/heldzero.py reads it).

Dia zeroes its cross-attention's keys at the text's padding (`k.masked_fill(~padding_mask, 0)`, V left as is), so
that a key the mask keeps there scores nothing: a key row that is zero in every head and every dimension of K is no
token's. Recorded per batch row as the keys that are so ("zero_keys": bool (B, Lk)), where some are and some are not.

Cheap where there is nothing to find: zerokv's reading of the first dimension of every row's and head's first and last
key comes first (most calls: none of them zero, the call is left), then V's at those keys (a static cache's unwritten
slots are zero in V too: left); past them, one numpy count over K's and V's first dimension and, for the keys it
leaves, their every dimension. CPU tensors only, of at most trace/padded.MOST keys over every
row and head (a batch's padding, not a long cache's slots: its cost does not grow with them).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST
from maskcli.trace.zerokv import _cpu, _edges_nonzero


def zero_keys(k: torch.Tensor, v: torch.Tensor, k_shape: tuple, edges: bool | None = None) -> dict:
    """{"zero_keys": bool (B, Lk)} where some of K's keys are zero in every head and dimension (V not: a slot nobody
    wrote is zero in both, zerokv.py's) and some are not; {} else (K not a 4-D CPU tensor, larger than a batch's
    padding, or no such key). `edges`: zerokv._edges_nonzero(k, k_shape) where the caller read it already."""
    if len(k_shape) != 4 or k_shape[0] * k_shape[1] * k_shape[2] > MOST or k_shape[-2] < 2:  # (a long cache: not read)
        return {}
    try:
        if _edges_nonzero(k, k_shape) if edges is None else edges:
            return {}
        cells, values = _cpu(k), _cpu(v)
        if cells is None or values is None or cells.shape[:3] != tuple(k_shape[:3]) or values.shape[:3] != cells.shape[:3]:
            return {}
        if not any(((cells[:, :, at, 0] == 0) & (values[:, :, at, 0] != 0)).any() for at in (0, -1)):
            return {}  # (no edge key zero in K alone: a static cache's unwritten slots, zero in V too, or none)
        zero = ~(cells[..., 0] != 0).any(axis=1) & (values[..., 0] != 0).any(axis=1)  # (B, Lk): K's first dim 0, V's not
        if not zero.any() or zero.all():
            return {}
        rows, keys = np.nonzero(zero)
        zero[rows, keys] = ~(cells[rows, :, keys] != 0).any(axis=(1, 2))  # (each such key read whole)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, compiled, meta) states nothing
        return {}
    return {"zero_keys": zero} if zero.any() and not zero.all() else {}
