"""A captured keep tensor into its stored form, a band of rows at a time on its own device; each mask stored once.

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
CACHE = 256  # masks remembered by the tensor they were read from (a model hands one mask to every layer)


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
        starts, ends = found  # each row's maximal runs in order, padded with [Lk, Lk) (by_row): already the normal
        intervals = Intervals(starts, ends, 0, k_len)  # form Intervals.of would make, at a tenth of its cost
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
    cells = _cpu_cells(planes)
    if cells is not None:
        return _runs_numpy(cells.reshape(count * q_len, k_len), count, q_len)
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


def _cpu_cells(tensor: torch.Tensor) -> np.ndarray | None:
    """The tensor's cells as a numpy view where it lives on the CPU (numpy's calls cost a few us where torch's cost tens:
    the masks of one call each are the trace's hot path); None elsewhere (a GPU's, a subclass, a functional tensor)."""
    if tensor.device.type != "cpu":
        return None
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):
        return None


def _runs_numpy(rows: np.ndarray, count: int, q_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """_runs of (P * Lq, Lk) bool rows on the CPU, a band of rows at a time as there: the rows laid end to end with a
    False between each two, so that every change of value is a run's start or end and none crosses a row."""
    total, k_len = rows.shape
    one = _one_run(rows)
    if one is not None:
        return one[0].reshape(count, q_len, 1), one[1].reshape(count, q_len, 1)
    width = k_len + 1
    per_band = max(1, BAND // width)
    found, starts, ends = [], [], []
    for lo in range(0, total, per_band):
        band = rows[lo : lo + per_band]
        n = band.shape[0]
        flat = np.zeros(n * width + 1, bool)  # flat[1 + r * width + col] = band[r, col]; flat[0] and each row's last: False
        flat[1:].reshape(n, width)[:, :k_len] = band
        changes = np.flatnonzero(flat[1:] != flat[:-1])  # cell r * width + col that differs from the cell before it
        rise, fall = changes[0::2], changes[1::2]  # (False before and after each row: starts and ends alternate)
        row = rise // width
        if int(np.bincount(row, minlength=1).max()) > MAX_PER_ROW:
            return None
        found.append(row + lo)
        starts.append(rise - row * width)
        ends.append(fall - row * width)
    s_out, e_out = by_row(*(np.concatenate(x).astype(np.int64) for x in (found, starts, ends)), count * q_len, k_len)
    return s_out.reshape(count, q_len, -1), e_out.reshape(count, q_len, -1)


def _one_run(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts, ends) of (P * Lq, Lk) bool rows where each has at most one run (causal, a window, padding: most masks),
    [Lk, Lk) for a row with none, as _runs_numpy gives them; None where some row has more. Four passes over the cells
    where the general path makes a copy, a diff and a nonzero of them."""
    if not rows.size:
        return None
    k_len = rows.shape[1]
    first = rows.argmax(axis=1)
    last = k_len - rows[:, ::-1].argmax(axis=1)
    count = np.count_nonzero(rows, axis=1)
    empty = count == 0
    if not ((count == last - first) | empty).all():
        return None
    return np.where(empty, k_len, first).astype(np.int64), np.where(empty, k_len, last).astype(np.int64)


def store(trace, seen) -> str:
    """Store the mask a reader saw (trace.masks, once per digest) and return its key: a mask tensor given again unchanged
    (its id and version counter: a model hands one mask to every layer) is not read again."""
    if seen.intervals is not None:  # (the readers' own intervals for one shape are one object: masks.top_left_causal)
        cache_key = ("intervals", id(seen.intervals), seen.shape, seen.planes)
        found = trace._cache.get(cache_key)
        if found is not None:
            return found[0]
        stored = tracefile.from_intervals(seen.intervals, seen.shape, seen.planes)
        key = keep_stored(trace, stored, seen.shape)
        _remember(trace, cache_key, (key, seen.intervals))  # (the intervals held, so that their id stays theirs)
        return key
    cache_key = None
    if seen.sources:  # the same mask tensor given again (every layer of a model): read it once
        # (its version counter moves with every change in place: a mask changed between calls is read again)
        cache_key = (seen.api, seen.shape, tuple((id(x), x._version) for x in seen.sources))
        found = trace._cache.get(cache_key)
        if found is not None:
            seen.details.update(found[2])  # (what reading it said: a bias, a 0/1 mask added)
            return found[0]
    keep = collapse(seen.materialize())
    stored = stored_form(keep, seen.shape, trace.max_bytes - trace.bytes, trace.max_bytes)
    key = keep_stored(trace, stored, seen.shape)
    if cache_key is not None:
        _remember(trace, cache_key, (key, seen.sources, seen.made))  # the tensors are held so that their ids stay theirs
    return key


def _remember(trace, cache_key: tuple, found: tuple) -> None:
    if len(trace._cache) >= CACHE:
        trace._cache.clear()
    trace._cache[cache_key] = found


def keep_stored(trace, stored: dict, shape) -> str:
    """The key of a stored mask in trace.masks, kept once; past trace.max_bytes its counts only."""
    key = tracefile.digest(stored)
    if key in trace.masks:
        return key
    size = tracefile.nbytes(stored)
    if size and trace.bytes + size > trace.max_bytes:
        found = tracefile.counts(stored)
        factor = (shape[0] * shape[1]) // (found.shape[0] * found.shape[1])
        kept, empty = int(found.sum()) * factor, int((found == 0).sum()) * factor
        stored = tracefile.stats_only(shape, kept, empty, f"past --max-bytes {trace.max_bytes}")
        key = tracefile.digest(stored)
        size = 0
    trace.masks.setdefault(key, stored)
    trace.bytes += size
    return key


def collapse(keep: torch.Tensor) -> torch.Tensor:
    """The batch and head dimensions cut to 1 where every row of them is the same."""
    cells = _cpu_cells(keep)
    if cells is not None:  # (numpy's compare: a few us, where torch's costs tens)
        for dim in (0, 1):
            if cells.shape[dim] > 1 and bool((cells == cells.take([0], axis=dim)).all()):
                keep = keep.narrow(dim, 0, 1)
                cells = cells.take([0], axis=dim)
        return keep
    for dim in (0, 1):
        if keep.shape[dim] > 1 and bool((keep == keep.narrow(dim, 0, 1)).all()):
            keep = keep.narrow(dim, 0, 1)
    return keep
