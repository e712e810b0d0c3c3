"""Exact counts of visible cells per block of a mask: from its intervals, or by tiles of cells.

Intervals count a block in O(rows x key blocks); a mask whose intervals are not few (a
tensor, labels that go down) is counted cell by cell, a band of rows at a time, so memory
stays bounded. Either way the count is exact: no block with a visible cell reads as empty.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.mask import Mask

TILE_CELLS = 1 << 22  # cells per band when counting cell by cell: a predicate's int64 temporaries stay near 100 MB
# Past this many cells a predicate is not counted cell by cell: about a minute's work at the ~130M cells/s that
# labels' predicates reach on one core (benchmarks/long_masks.py), hours at 1M tokens. Refused up front instead.
CELL_BY_CELL_LIMIT = 1 << 33
# A kind that counts its own keys (Kind.counts) answers per key edge in O(Lq): past this many query rows x edges
# (a fine block grid at 1M tokens) the blocks are counted cell by cell instead, under the limit above
COUNTED_LIMIT = 1 << 28
PATIENCE_S = 120.0  # a slower predicate (a user's mask_mod) is refused once its first bands say it would take longer
PACE_AFTER_S = 0.5  # the pace is judged after this long


def check_cell_by_cell(masks: tuple[Mask, ...], planes: int = 1) -> None:
    """Refuse, in O(1) and before torch is imported, counting `planes` planes of predicate cells past the limit."""
    slow = [m for m in masks if m.keep is None and not m.exact]
    if not slow:
        return
    f = masks[0].frame
    cells = planes * f.q_len * f.k_len
    if cells > CELL_BY_CELL_LIMIT:
        side = int((CELL_BY_CELL_LIMIT // planes) ** 0.5)
        raise MaskError(
            f"{slow[0].title}: {slow[0].why_not_exact}, so its keys are not a few intervals per query and it would be "
            f"counted cell by cell: {cells:,} cells, past the {CELL_BY_CELL_LIMIT:,} (about a minute) maskcli counts "
            f"that way: use a shorter mask (about {side:,} queries x {side:,} keys fits)"
        )


def bands(masks: tuple[Mask, ...], total_rows: int, progress=None, done_before: int = 0, total: int | None = None, align: int = 1):
    """(lo, hi) query bands of about TILE_CELLS cells (a multiple of `align` rows) over `total_rows` rows, for
    counting cell by cell.

    Calls progress(done, total) after each band, and, where a predicate is slow, refuses the work
    once its first bands say that the whole would take longer than PATIENCE_S.
    """
    import time

    f = masks[0].frame
    band = max(align, TILE_CELLS // max(1, f.k_len) // align * align)
    total = total_rows if total is None else total
    watching = any(m.keep is None and not m.exact for m in masks)  # a predicate, counted cell by cell
    start = first = None
    for lo in range(0, total_rows, band):
        hi = min(total_rows, lo + band)
        yield lo, hi
        done = done_before + hi
        if watching and start is None:  # the pace is timed from the second band: the first pays for imports
            start, first = time.monotonic(), hi
        elif watching:
            elapsed = time.monotonic() - start
            if elapsed >= PACE_AFTER_S:
                watching = False
                expected = elapsed * (total - done_before - first) / max(1, hi - first)
                if expected > PATIENCE_S:
                    raise MaskError(
                        f"{masks[0].title}: counting it cell by cell would take about {expected / 60:.0f} minutes here "
                        f"({f.q_len:,} x {f.k_len:,} cells through its predicate): use a shorter mask"
                    )
        if progress is not None:
            progress(done, total)


def edges(length: int, block: int, start: int = 0) -> np.ndarray:
    """Block boundaries start, start+block, ..., start+length (the last block may be shorter)."""
    return np.minimum(np.arange(0, length + block, block, dtype=np.int64), length)[: -(-length // block) + 1] + start


def block_counts(mask: Mask, b: int, h: int, row_block: int, key_block: int, progress=None) -> np.ndarray:
    """Visible cells per block of `row_block` queries x `key_block` keys, int64, exactly.

    From the intervals where they are few; else cell by cell, a band of rows at a time,
    calling progress(rows done, rows) after each band.
    """
    f = mask.frame
    if mask.exact:
        return mask.intervals().block_counts(b, f.q_len, row_block, key_block)
    n_rows, n_cols = -(-f.q_len // row_block), -(-f.k_len // key_block)
    if mask.counted is not None and (n_cols + 1) * f.q_len <= COUNTED_LIMIT:
        # a block's cells are its rows' keys before its right edge less those before its left edge
        out = np.zeros((n_rows, n_cols), dtype=np.int64)
        row_starts = edges(f.q_len, row_block)[:-1]
        previous = None
        for j, below in enumerate(mask.counted.keys_below(b, edges(f.k_len, key_block, f.k_start))):
            if previous is not None:
                out[:, j - 1] = np.add.reduceat(below - previous, row_starts)
            previous = below
        return out
    check_cell_by_cell((mask,))
    out = np.zeros((n_rows, n_cols), dtype=np.int64)
    # a band of at most TILE_CELLS cells, whatever the block: a block of rows may span several bands,
    # each adding its part, so memory stays bounded as the mask grows
    key_edges = edges(f.k_len, key_block)
    for lo, hi in bands((mask,), f.q_len, progress):
        cells = mask.cells(b, h, lo, hi)
        per_key_block = np.add.reduceat(cells, key_edges[:-1], axis=1, dtype=np.int64)
        rows_of = np.arange(lo, hi) // row_block
        out[rows_of[0] : rows_of[-1] + 1] += np.add.reduceat(per_key_block, np.flatnonzero(np.r_[True, np.diff(rows_of) > 0]), axis=0)
    return out


def block_shares(mask: Mask, b: int, h: int, rows: int, cols: int, progress=None) -> np.ndarray:
    """Share of visible cells (0..1) per block of `rows` queries x `cols` keys, exactly."""
    f = mask.frame
    counts = block_counts(mask, b, h, rows, cols, progress)
    return counts / (np.diff(edges(f.q_len, rows))[:, None] * np.diff(edges(f.k_len, cols))[None, :])


def how_counted(mask: Mask) -> str:
    """Which exact path counted the cells, in words."""
    if mask.exact:
        return "exact, from key intervals"
    if mask.counted is not None:
        return f"exact, from running counts per label ({mask.why_not_exact})"
    return f"exact, cell by cell ({mask.why_not_exact})"
