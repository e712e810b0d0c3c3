"""Per-rank masks a traced run captured, checked against the global mask under a layout.

A rank's mask is PyTorch's convention for context parallelism: its rows are the rank's slots in local order,
its columns every slot in the gathered (permuted) order, and both are mapped back to global positions through
the layout's indices before the mask is read (_create_cp_block_mask's qkv_idx_restore,
torch/distributed/tensor/experimental/_context_parallel/_attention.py:1250-1283). What a rank should hold comes from
the ranks source (sources/ranks.py: the global Mask over each run of positions it holds), laid out in that order
(`gathered`). Cells are compared densely: the files are dense already.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks import registry as rules
from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.mask import Mask, MaskOptions
from maskcli.shard.layouts import Layout
from maskcli.shard.work import intervals_of
from maskcli.text import Finding


def cells_at(intervals: Intervals, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Bool (len(rows), len(keys)): the mask at those positions (-1 rows or keys: never visible)."""
    k = intervals.per_row
    starts = np.broadcast_to(intervals.starts[0], (intervals.starts.shape[1], k))
    ends = np.broadcast_to(intervals.ends[0], starts.shape)
    pick = np.where(rows >= 0, rows, 0) if starts.shape[0] > 1 else np.zeros(rows.shape, dtype=np.int64)
    s, e = starts[pick], ends[pick]
    out = np.zeros((rows.size, keys.size), dtype=bool)
    for c in range(k):  # K is small: a pass per interval column
        out |= (keys[None, :] >= s[:, c, None]) & (keys[None, :] < e[:, c, None])
    out[rows < 0] = False
    out[:, keys < 0] = False
    return out


def load_part(path: str) -> np.ndarray:
    """A rank's captured mask as bool (rows, keys), True = may attend.

    A bool tensor is read as SDPA reads it (True = may attend), which is what ring attention hands each step:
    a rank's part, its rows permuted, often does not show its convention by its structure. Other values (and
    TRACE.pt:N) are read as every --mask file is."""
    from maskcli.sources import trace
    from maskcli.sources.registry import from_file
    from maskcli.sources.tensor import load_mask

    if not trace.claims(path):
        values, label = load_mask(path, None, "--rank-mask")
        if values.dtype == bool:
            keep = values.reshape((1,) * (4 - values.ndim) + values.shape) if values.ndim < 4 else values
            return _one_plane(keep, path)
    return _one_plane(from_file(path, MaskOptions(), "--rank-mask").keep, path)


def _one_plane(keep: np.ndarray, path: str) -> np.ndarray:
    if keep.ndim != 4 or keep.shape[0] > 1 or keep.shape[1] > 1:
        raise MaskError(f"--rank-mask {path!r} has shape {list(keep.shape)}: give one (rows, keys) mask a rank, not batch rows or heads")
    return keep[0, 0]


def check(mask: Mask, layout: Layout, paths: list[str]) -> list[Finding]:
    """Each rank's captured part against the global mask: a finding per rank whose part differs."""
    if len(paths) != layout.ranks:
        raise MaskError(f"--rank-mask given {len(paths) if len(paths) != 1 else 'once'}{' times' if len(paths) != 1 else ''} but --ranks is {layout.ranks}: give one file per rank, in rank order")
    keys = layout.indices().size
    parts = []
    for r, path in enumerate(paths):
        part = load_part(path)
        rows = layout.rank_indices(r)
        if part.shape != (rows.size, keys):
            raise MaskError(f"--rank-mask {path!r} has shape {list(part.shape)} but rank {r} holds {rows.size:,} slots of "
                            f"{keys:,} under --layout {layout.name}: give its (local rows, all keys) mask, or the right --layout")
        parts.append(part)
    return check_parts(mask, layout, parts)


def gathered(runs: list[Mask], rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """A rank's part of the global mask as context parallelism hands it, bool (its slots, every slot): each run's
    cells (sources/ranks.py: the global Mask over each run the rank holds) at its slots in local order, read off the
    run's key intervals in the gathered order of the keys (`cells_at`); a padding slot's row and column empty."""
    out = np.zeros((rows.size, keys.size), dtype=bool)
    real = np.flatnonzero(rows >= 0)  # each run's slots lie together in local order, the runs in the source's order
    at = 0
    for run in runs:
        n = run.frame.q_len
        out[real[at] : real[at] + n] = cells_at(intervals_of(run), np.arange(n), keys)
        at += n
    return out


def check_parts(mask: Mask, layout: Layout, parts: list[np.ndarray]) -> list[Finding]:
    """Each rank's part, bool (its slots, every slot in the gathered order), against the global mask: what each rank
    should hold is read through the ranks source (sources/ranks.py), in PyTorch's order (`gathered`)."""
    from maskcli.sources import registry

    held = registry.sources()["ranks"].load(layout, mask)
    intervals = intervals_of(mask)
    order = layout.indices()
    keys = np.where(order < layout.length, order, -1)
    local_keys = np.where(np.arange(keys.size) < layout.length, np.arange(keys.size), -1)
    found: list[Finding] = []
    for r, part in enumerate(parts):
        rows = layout.rank_indices(r)
        expected = gathered(held[r], rows, keys)
        local_rows = np.where(rows >= 0, np.arange(rows.size), -1)
        local = cells_at(intervals, np.where(local_rows < layout.length, local_rows, -1), local_keys)
        causal = (rows[:, None] >= keys[None, :]) & (rows[:, None] >= 0) & (keys[None, :] >= 0)
        found += rules.run("part", expected, part, rows, keys, r, mask.title, local, causal)
    return found
