"""Keys a program zeroed in K alone: its own statement of which keys are padding (checks/heldzero.py reads it).

Dia zeroes its cross-attention's keys at the text's padding (`k.masked_fill(~padding_mask, 0)`, V left as is), so
that a key the mask keeps there scores nothing: a key row that is zero in every head and every dimension of K is no
token's. Recorded per batch row as the keys that are so ("zero_keys": bool (B, Lk)), where some are and some are not.

Cheap where there is nothing to find: zerokv's reading of the first dimension of every row's and head's first and last
key comes first (most calls: none of them zero, the call is left); past it, one numpy count over K's first dimension
and, for the keys it leaves, their every dimension. CPU tensors only, of a batch's padding size (trace/padded.MOST).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST
from maskcli.trace.zerokv import _cpu, _edges_nonzero


def zero_keys(k: torch.Tensor, k_shape: tuple) -> dict:
    """{"zero_keys": bool (B, Lk)} where some of K's keys are zero in every head and dimension and some are not; {}
    else (K not a 4-D CPU tensor, larger than a batch's padding, or no such key)."""
    if len(k_shape) != 4 or k_shape[0] * k_shape[2] > MOST or k_shape[-2] < 2:
        return {}
    try:
        if _edges_nonzero(k, k_shape):
            return {}
        cells = _cpu(k)
        if cells is None or cells.shape[:3] != tuple(k_shape[:3]):
            return {}
        zero = ~(cells[..., 0] != 0).any(axis=1)  # (B, Lk): zero in every head's first dimension
        if not zero.any() or zero.all():
            return {}
        rows, keys = np.nonzero(zero)
        zero[rows, keys] = ~(cells[rows, :, keys] != 0).any(axis=(1, 2))  # (each such key read whole)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, compiled, meta) states nothing
        return {}
    return {"zero_keys": zero} if zero.any() and not zero.all() else {}
