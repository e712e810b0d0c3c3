"""A captured keep tensor into its stored form, a band of rows at a time on its own device.

A model hands SDPA a (B, 1, L, L) bool mask even at 32k tokens (a gigabyte of cells);
its rows are still a few runs each. So the runs are found band by band where the tensor
lives, and only their ends come back: O(L) numbers for a causal or padded mask. Only where
some row has many runs are the cells kept, as packed bits, and only while they fit --max-bytes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from maskcli import tracefile
from maskcli.tracefile import by_row
from maskcli.intervals import MAX_PER_ROW, Intervals

BAND = 1 << 24  # cells of one band of rows


def stored_form(keep: torch.Tensor, shape: tuple[int, ...], room: int, limit: int) -> dict:
    """Intervals where every row has few runs, else bits if they fit in the `room` bytes left of `limit`, else counts.

    `keep` is bool (b, h, Lq, Lk) with b and h each 1 or the call's own; a query dimension
    that is broadcast (stride 0: one row for every query) is read once.
    """
    b, h, q_len, k_len = keep.shape
    one_row = q_len > 1 and keep.stride(2) == 0
    rows = keep[:, :, :1] if one_row else keep
    found = _runs(rows.reshape(b * h, rows.shape[2], k_len))
    if found is not None:
        starts, ends = found
        intervals = Intervals.of(starts, ends, 0, k_len)
        return tracefile.from_intervals(intervals, shape, (b, h))
    if keep.numel() // 8 <= room:
        return {"form": "bits", "shape": [int(x) for x in shape], "planes": [b, h],
                "bits": np.packbits(keep.cpu().numpy(), axis=-1)}
    kept = int(keep.sum()) * (shape[0] // b) * (shape[1] // h)
    empty = int((~keep.any(-1)).sum()) * (shape[0] // b) * (shape[1] // h)
    return tracefile.stats_only(shape, kept, empty, f"past --max-bytes {limit}")


def _runs(planes: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """starts, ends (P, Lq, K) of each row's runs of True; None where a row has more than MAX_PER_ROW."""
    count, q_len, k_len = planes.shape
    if count * q_len == 0:  # attention over 0 queries (an empty batch, an empty prompt): no row, no run
        empty = np.zeros((count, q_len, 1), dtype=np.int64)  # (one empty run a row: [0, 0))
        return empty, empty.copy()
    per_band = max(1, BAND // (k_len + 2))
    rows, starts, ends = [], [], []
    for p in range(count):
        for lo in range(0, q_len, per_band):
            band = F.pad(planes[p, lo : lo + per_band].to(torch.int8), (1, 1))
            edges = torch.diff(band, dim=1)
            rising = edges == 1
            if int(rising.sum(dim=1).max()) > MAX_PER_ROW:
                return None
            row, begin = rising.nonzero(as_tuple=True)  # row-major: ascending rows, each row's runs in order
            _, finish = (edges == -1).nonzero(as_tuple=True)
            rows.append(row.cpu().numpy() + p * q_len + lo)
            starts.append(begin.cpu().numpy())
            ends.append(finish.cpu().numpy())
    s_out, e_out = by_row(*(np.concatenate(x).astype(np.int64) for x in (rows, starts, ends)), count * q_len, k_len)
    return s_out.reshape(count, q_len, -1), e_out.reshape(count, q_len, -1)
