"""Statistics of a mask at any length, exactly: visible cells, keys per query row, rows that see
nothing, attention FLOPs against dense, and a density grid.

From the key intervals these are O(rows); a mask whose intervals are not few is counted
cell by cell, a band of rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from maskcli.counting import bands, block_counts, check_cell_by_cell, how_counted
from maskcli.mask import Mask

DEFAULT_GRID = (32, 64)
MAX_SPANS = 8


@dataclass(frozen=True, eq=False)
class Seen:
    """One Mask as a view reads it, asked of the Mask once (`seen`): its positions, name and how its cells are
    counted as plain values, and its cells and intervals as its own bound methods. A view (render/masks.py's
    `mask_views`, show's empty rows, counting's blocks) reads these again and again: asked of the Mask, each would
    be a call into mask.py. It is read where a Mask is (the same names); `mask` is the Mask itself."""

    mask: Mask
    text: str
    frame: object
    batch: int
    heads: int
    tree: object | None
    expression: object | None
    tokens: tuple[str, ...] | None
    keep: np.ndarray | None
    whole: object | None
    shape: tuple[int, int, int, int]
    title: str
    q_offset: int
    kv_offset: int
    exact: bool
    why_not_exact: str | None
    counted: object | None
    cells: Callable[..., np.ndarray]
    intervals: Callable[[], object]
    dense: Callable[[], np.ndarray]


def seen(mask: Mask) -> Seen:
    """What a view reads of `mask`, read once (its intervals made here where they are few, as a view's counts
    need them; a kind's own counts only where they are not)."""
    return Seen(mask, mask.text, mask.frame, mask.batch, mask.heads, mask.tree, mask.expression, mask.tokens,
                mask.keep, mask.whole, mask.shape, mask.title, mask.q_offset, mask.kv_offset, mask.exact,
                mask.why_not_exact, mask.counted, mask.cells, mask.intervals, mask.dense)


@dataclass(frozen=True)
class RowStats:
    """One batch row, over every one of its heads: a (head, query) pair is one query row."""

    batch: int
    visible: int  # visible cells of this batch row, every head
    total: int
    keys_min: int  # keys per query row, over every head's query rows
    keys_median: float
    keys_max: int
    empty_rows: int  # (head, query) rows that see no key
    empty_spans: list[tuple[int, int]]  # query positions that see no key in some head: first..last, up to MAX_SPANS


@dataclass(frozen=True)
class Summary:
    mask: Mask
    rows: list[RowStats]
    how: str
    grid: list[np.ndarray] | None  # visible cells per grid block, every head, one (R, C) per batch row (None: not asked for)
    grid_blocks: tuple[int, int]  # queries x keys per grid block

    @property
    def visible(self) -> int:
        """Visible cells of the whole mask: every batch row and head."""
        return sum(r.visible for r in self.rows)

    @property
    def total(self) -> int:
        batch, heads, q_len, k_len = self.mask.shape
        return batch * heads * q_len * k_len

    def json(self) -> dict:
        rb, cb = self.grid_blocks
        return {
            **self.mask.json(),
            "visible_cells": self.visible,
            "total_cells": self.total,
            "share": self.visible / self.total,
            "counted": self.how,
            "cells_counted": f"every head (H={self.mask.heads}): in visible_cells, in each of batch_rows and in the grid; "
            "row_keys and empty_rows are over every (head, query) row",
            "batch_rows": [
                {
                    "batch": r.batch, "visible_cells": r.visible, "total_cells": r.total, "share": r.visible / r.total,
                    "row_keys": {"min": r.keys_min, "median": r.keys_median, "max": r.keys_max},
                    "empty_rows": r.empty_rows, "empty_row_spans": [list(span) for span in r.empty_spans],
                }
                for r in self.rows
            ],
            "flops": {
                "per_head_dim": 4 * self.visible,
                "dense_per_head_dim": 4 * self.total,
                "note": "4·D per visible cell: Q Kᵀ and weights·V, 2·D each, over every batch row and head",
            },
            **({} if self.grid is None else {"grid": {"queries_per_block": rb, "keys_per_block": cb, "visible": [g.tolist() for g in self.grid]}}),
        }


def row_counts(mask: Mask, b: int, h: int = 0, progress=None) -> np.ndarray:
    """Visible keys per query row of batch row b, head h, int64 (Lq,)."""
    f = mask.frame
    if mask.exact:
        counts = mask.intervals().counts()
        return np.broadcast_to(counts[b if counts.shape[0] > 1 else 0], (f.q_len,))
    if mask.counted is not None:
        return next(mask.counted.keys_below(b, [f.k_end]))
    check_cell_by_cell((mask,))
    out = np.empty(f.q_len, dtype=np.int64)
    for lo, hi in bands((mask,), f.q_len, progress):
        out[lo:hi] = mask.cells(b, h, lo, hi).sum(axis=1)
    return out


def spans(flags: np.ndarray, start: int, most: int = MAX_SPANS) -> list[tuple[int, int]]:
    """(first, last) of each run of True, as absolute positions from `start`; the first `most` runs."""
    edges = np.diff(flags.astype(np.int8), prepend=0, append=0)
    firsts = np.flatnonzero(edges == 1)[:most]
    lasts = np.flatnonzero(edges == -1)[:most] - 1
    return [(int(start + a), int(start + z)) for a, z in zip(firsts, lasts)]


def summarise(mask: Mask, grid: tuple[int, int] = DEFAULT_GRID, progress=None, with_grid: bool = True) -> Summary:
    """Counts per batch row over every head (and the density grid, which only --json shows, where `with_grid`).

    Where every head holds head 0's mask, head 0 is counted and the cell counts are multiplied by the heads."""
    f = mask.frame
    rb, cb = -(-f.q_len // grid[0]), -(-f.k_len // grid[1])
    heads = range(mask.heads) if mask.heads_differ else range(1)
    copies = 1 if mask.heads_differ else mask.heads
    exact = mask.exact
    if exact:  # every batch row's statistics in one pass over the (B, Lq) counts (exact in float64: below 2^53)
        counts = np.broadcast_to(mask.intervals().counts(), (mask.batch, f.q_len))
        table = np.stack([counts.sum(1), counts.min(1), np.median(counts, axis=1), counts.max(1), (counts == 0).sum(1)], axis=1)
    rows = []
    for b in range(mask.batch):
        per_head = counts[b][None] if exact else np.stack([row_counts(mask, b, h, progress) for h in heads])
        visible, low, middle, high, empty = table[b] if exact else (
            per_head.sum(), per_head.min(), np.median(per_head), per_head.max(), (per_head == 0).sum())
        rows.append(RowStats(
            batch=b, visible=int(visible) * copies, total=mask.heads * f.q_len * f.k_len, keys_min=int(low),
            keys_median=float(middle), keys_max=int(high), empty_rows=int(empty) * copies,
            empty_spans=spans((per_head == 0).any(0), f.q_start) if empty else [],
        ))
    grids = None
    if with_grid:
        grids = [sum(block_counts(mask, b, h, rb, cb, progress) for h in heads) * copies for b in range(mask.batch)]
    return Summary(mask, rows, how_counted(mask), grids, (rb, cb))
