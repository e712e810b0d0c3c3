"""A captured keep tensor into its stored form, a band of rows at a time on its own device; each mask stored once.

A model hands SDPA a (B, 1, L, L) bool mask even at 32k tokens (a gigabyte of cells);
its rows are still a few runs each. So the runs are found band by band where the tensor
lives, and only their ends come back: O(L) numbers for a causal or padded mask. Only where
some row has many runs are the cells kept, as packed bits, and only while they fit --max-bytes.

Reading a mask costs more than a small model's attention call, so, as profilers do, a call
keeps a copy of its mask's own cells (the dimensions it broadcasts left out: a padding row is
B x Lk cells) under a placeholder key, and the copies are read after the run (read_unread,
when the calls or masks are first asked for), each distinct content once. A mask past DEFER
cells is read at the call, as are the copies once they hold UNREAD bytes (memory stays bounded).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F

from maskcli import tracefile
from maskcli.tracefile import by_row
from maskcli.intervals import MAX_PER_ROW, Intervals

BAND = 1 << 24  # cells of one band of rows
CACHE = 256  # masks remembered by the tensor they were read from (a model hands one mask to every layer)
DEFER = 1 << 22  # cells of a mask's own (not broadcast) copied at the call and read after the run; more: read at once
UNREAD = 64 << 20  # bytes of copies held unread at most (past it they are read during the run)
OBJECT = 512  # bytes a copy holds beside its cells (its tensor, storage and key), counted against UNREAD
PENDING = "unread:"  # the key a call holds until its mask's copy is read (a digest is hex: never this)


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
    if seen.sources and not any(x.is_inference() for x in seen.sources):  # the same mask tensor given again (every
        # layer of a model): read it once (one made under torch.inference_mode has no version counter: read each time)
        # (its version counter moves with every change in place: a mask changed between calls is read again)
        cache_key = (seen.api, seen.shape, tuple((id(x), x._version) for x in seen.sources))
        found = trace._cache.get(cache_key)
        if found is not None:
            seen.details.update(found[2])  # (what reading it said: a bias, a 0/1 mask added)
            return found[0]
    keep = seen.materialize()
    copy = _copy(keep)
    if copy is not None:  # read after the run (read_unread)
        key = f"{PENDING}{len(trace._read) + len(trace._unread)}"
        trace._unread[key] = (copy, tuple(keep.shape), tuple(map(int, seen.shape)))
        trace._unread_bytes += copy.numel() + OBJECT  # (a million tiny masks: their tensors' own bytes count too)
        if trace._unread_bytes > UNREAD:
            read_unread(trace)
    else:
        stored = stored_form(collapse(keep), seen.shape, trace.max_bytes - trace.bytes, trace.max_bytes)
        key = keep_stored(trace, stored, seen.shape)
    if cache_key is not None:
        _remember(trace, cache_key, (key, seen.sources, seen.made))  # the tensors are held so that their ids stay theirs
    return key


def _copy(keep: torch.Tensor) -> torch.Tensor | None:
    """A copy of `keep`'s own cells (each broadcast dimension, stride 0, cut to 1: expand() makes `keep` again), or
    None where they are more than DEFER (read at the call: no large copy held)."""
    try:
        own = keep
        for dim in range(keep.dim()):
            if keep.shape[dim] > 1 and keep.stride(dim) == 0:
                own = own.narrow(dim, 0, 1)
        return own.clone() if own.numel() <= DEFER else None
    except (RuntimeError, NotImplementedError):  # (a tensor without strides: read at the call)
        return None


def read_unread(trace) -> dict:
    """The masks copied at their calls and not yet read, read now in the order of their calls (so --max-bytes is spent
    as it would be at the calls) and stored (trace._masks); trace._read maps each placeholder key to its digest, and is
    returned. Copies of the same content are read once."""
    unread, done, seen = trace._unread, trace._read, trace._contents
    while unread:  # (a list of them: next(iter(unread)) after deleting the first k skips k dead slots, quadratic)
        for key, (copy, shape, call_shape) in list(unread.items()):
            _read_one(trace, key, copy, shape, call_shape, done, seen)
            del unread[key]
    trace._unread_bytes = 0
    return done


def _read_one(trace, key: str, copy: torch.Tensor, shape: tuple, call_shape: tuple, done: dict, seen: dict) -> None:
    """One copy read and stored (done[key]: its digest), or known again by its content (seen)."""
    cells = _cpu_cells(copy)
    content = None
    if cells is not None:
        content = (shape, call_shape, tuple(copy.shape), hashlib.blake2b(cells.tobytes(), digest_size=16).digest())
    if content is not None and content in seen:
        done[key] = seen[content]
        return
    keep = collapse(copy.expand(shape))
    stored = stored_form(keep, call_shape, trace.max_bytes - trace.bytes, trace.max_bytes)
    done[key] = keep_stored(trace, stored, call_shape)
    if content is not None:
        seen[content] = done[key]


def read_calls(trace) -> None:
    """The copies of masks made at the calls read and stored, and each call's placeholder key replaced by its digest
    (those recorded since the last time, and those whose mask changed after they were recorded: trace._late)."""
    from itertools import chain, islice

    with trace._lock:
        local = trace._local
        busy, local.busy = local.busy, True  # (torch's calls made reading them are maskcli's own)
        try:
            read = read_unread(trace)
            if read:
                for call in chain(islice(trace._calls, trace._fixed, None), trace._late):
                    if call.mask is not None and call.mask.startswith(PENDING):
                        call.mask = read[call.mask]
            trace._late.clear()
            trace._fixed = len(trace._calls)
        finally:
            local.busy = busy


def unread_cells(trace, key: str) -> np.ndarray:
    """The cells of a mask stored under `key` (a placeholder or a digest), (b, h, Lq, Lk) with 1 where it broadcasts."""
    if key in trace._unread:
        copy, shape, _ = trace._unread[key]
        return np.broadcast_to(copy.cpu().numpy(), shape)
    return tracefile.dense(trace._masks[trace._read.get(key, key)])


def _remember(trace, cache_key: tuple, found: tuple) -> None:
    if len(trace._cache) >= CACHE:
        trace._cache.clear()
    trace._cache[cache_key] = found


def keep_stored(trace, stored: dict, shape) -> str:
    """The key of a stored mask in trace.masks, kept once; past trace.max_bytes its counts only."""
    key = tracefile.digest(stored)
    if key in trace._masks:
        return key
    size = tracefile.nbytes(stored)
    if size and trace.bytes + size > trace.max_bytes:
        found = tracefile.counts(stored)
        factor = (shape[0] * shape[1]) // (found.shape[0] * found.shape[1])
        kept, empty = int(found.sum()) * factor, int((found == 0).sum()) * factor
        stored = tracefile.stats_only(shape, kept, empty, f"past --max-bytes {trace.max_bytes}")
        key = tracefile.digest(stored)
        size = 0
    trace._masks.setdefault(key, stored)
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
