"""padding: the key padding of --lengths or --ids, per batch row.

Given --lengths or --ids, every mask is and-ed with its padding, so the kind adds
nothing to an expression but a name: `maskcli show padding --lengths 4,2` is the key
padding alone (every query sees every real key).
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import MAX_PER_ROW, Intervals, NotFew
from maskcli.kinds.base import Kind


CELLS = 1 << 22  # cells of a tensor's rows key_runs compares at a time


def key_runs(valid: np.ndarray, frame, what: str = "the padding", queries: bool = False) -> Intervals:
    """Runs of real (non-pad) keys per batch row, as (B, 1, K) intervals; `queries`: each row of `valid` read as a
    query row of one batch row, (1, B, K) (a tensor's cells). Reads `valid` (B, S) by two comparisons of
    neighbouring columns, a block of rows at a time (a 20,000^2 tensor's rows: no copy of it, in any dtype).
    `frame`: anything with the keys' k_start and k_end."""
    first, last = _runs(np.asarray(valid), frame.k_end, what)
    if queries:
        return Intervals.of(first[None], last[None], frame.k_start, frame.k_end)
    return Intervals.of(first[:, None, :], last[:, None, :], frame.k_start, frame.k_end)


def query_runs(parts: list[np.ndarray], what: str) -> list[Intervals | None]:
    """Each (Lq, Lk) matrix's cells as `key_runs` reads them with `queries` (keys 0..Lk), or None where a row has
    more runs than a few: several matrices in one call (the two readings of one tensor), their Intervals made
    together."""
    found = []
    for valid in parts:
        try:
            found.append(_runs(np.asarray(valid), valid.shape[1], what))
        except NotFew:
            found.append(None)
    return [None if runs is None else Intervals.of(runs[0][None], runs[1][None], 0, valid.shape[1])
            for runs, valid in zip(found, parts)]


def _runs(valid: np.ndarray, k_end: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) keys of each row's runs, (B, K) padded with k_end; NotFew past MAX_PER_ROW runs in a row."""
    batch, size = valid.shape
    stride = size + 1  # (a run's start and end keyed row * stride + column: its end may be `size`)
    found = [], []
    for rows in row_blocks(batch, size):  # (their temporaries stay small, and in cache)
        part = valid[rows].astype(bool, copy=False)
        found[0].append(_edges(part[:, 0], part[:, 1:] > part[:, :-1], 0, stride) + rows.start * stride)  # a real key
        found[1].append(_edges(part[:, -1], part[:, :-1] > part[:, 1:], size, stride) + rows.start * stride)  # after a
    starts, ends = (np.concatenate(keys) for keys in found)  # pad, or first; a pad after a real key, or the last
    rows, begin = np.divmod(starts, stride)
    finish = ends % stride
    counts = np.bincount(rows, minlength=batch)
    width = max(1, int(counts.max(initial=0)))
    if width > MAX_PER_ROW:
        raise NotFew(f"{what}: a batch row has {width} separate runs of real tokens")
    first = np.full((batch, width), k_end, dtype=np.int64)
    last = np.full((batch, width), k_end, dtype=np.int64)
    rank = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    first[rows, rank] = begin
    last[rows, rank] = finish
    return first, last


def row_blocks(rows: int, size: int) -> list[slice]:
    """The rows of a (rows, size) array in blocks of about CELLS cells (one row at least), as slices."""
    step = max(1, CELLS // max(1, size))
    return [slice(row, row + step) for row in range(0, rows, step)]


def _edges(outer: np.ndarray, inner: np.ndarray, at: int, stride: int) -> np.ndarray:
    """Sorted keys row * stride + column of the edges: rows where `outer` (a run at column `at`: 0 or the row's end),
    and the columns (1 after the cell) where `inner` (B, S - 1) is True."""
    found = np.flatnonzero(inner)  # 1-D nonzero: several times a 2-D one's speed
    rows, column = np.divmod(found, max(1, inner.shape[1]))
    keys = np.concatenate([np.flatnonzero(outer) * stride + at, rows * stride + column + 1])
    keys.sort()
    return keys


def _intervals(p, frame):
    if frame.lengths is not None:
        lengths = np.asarray(frame.lengths, dtype=np.int64).reshape(-1, 1, 1)
        if frame.pad_side == "left":  # the real tokens are the last `length` positions
            return Intervals.of(frame.n - lengths, np.int64(frame.n), frame.k_start, frame.k_end)
        return Intervals.of(np.int64(0), lengths, frame.k_start, frame.k_end)
    return key_runs(frame.key_valid, frame)


def _predicate(p, frame, device):
    import torch

    valid = torch.as_tensor(frame.key_valid, device=device)
    if valid.shape[0] == 1:  # one --ids/--lengths row serves every batch row of the other terms

        def padding_shared(b, h, q_idx, kv_idx):
            return valid[0, kv_idx.clamp(0, valid.shape[-1] - 1)] & (q_idx >= 0)

        return padding_shared

    def padding(b, h, q_idx, kv_idx):
        return valid[b, kv_idx.clamp(0, valid.shape[-1] - 1)] & (q_idx >= 0)

    return padding


def _why(p, frame, b, q, kv):
    real = bool(frame.key_valid[b if frame.key_valid.shape[0] > 1 else 0, kv])
    row = b if frame.batch > 1 else 0
    if frame.lengths is not None:
        length = frame.lengths[row]
        if frame.pad_side == "left":
            first = frame.n - length
            return real, (f"batch row {b} has length {length}, padded left (real keys {first}-{frame.n - 1}): "
                          f"kv {kv} {'>=' if real else '<'} {first}" + ("" if real else ", a pad key"))
        return real, f"batch row {b} has length {length}: kv {kv} {'<' if real else '>='} {length}" + ("" if real else ", a pad key")
    token = int(frame.ids[row, kv])
    if real:
        return True, f"ids[{b}][{kv}] = {token}, not the pad id {frame.pad_id}"
    return False, f"ids[{b}][{kv}] = {token}, the pad id: a pad key"


def _check(p, frame, where):
    if not frame.padded:
        raise MaskError(f"{where} needs --lengths (like 4,2) or --ids (like '1,2,3,0;4,5,0,0' with --pad-id 0)")


KINDS = (
    Kind(
        name="padding",
        meaning="key padding per batch row: keys at or past --lengths (before them with --pad left), or whose --ids are --pad-id, are hidden",
        keep="kv < length[b] (n - length[b] <= kv with --pad left; or ids[b, kv] != pad_id)",
        params=(),
        example="padding",
        options="--lengths 4,2",
        intervals=_intervals,
        predicate=_predicate,
        why=_why,
        rank=40,
        check=_check,
        frame_data=True,
    ),
)
