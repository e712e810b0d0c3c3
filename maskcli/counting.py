"""Exact counts of visible cells per block of a mask: from its intervals, or by tiles of cells.

Intervals count a block in O(rows x key blocks); a mask whose intervals are not few (a
tensor, labels that go down) is counted cell by cell, a band of rows at a time, so memory
stays bounded. Either way the count is exact: no block with a visible cell reads as empty.
"""

from __future__ import annotations

import numpy as np

from maskcli.mask import Mask

TILE_CELLS = 1 << 22  # cells per band when counting cell by cell: a predicate's int64 temporaries stay near 100 MB


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
    out = np.zeros((n_rows, n_cols), dtype=np.int64)
    # a band of at most TILE_CELLS cells, whatever the block: a block of rows may span several bands,
    # each adding its part, so memory stays bounded as the mask grows
    band = max(1, TILE_CELLS // max(1, f.k_len))
    key_edges = edges(f.k_len, key_block)
    for lo in range(0, f.q_len, band):
        hi = min(f.q_len, lo + band)
        cells = mask.cells(b, h, lo, hi)
        per_key_block = np.add.reduceat(cells, key_edges[:-1], axis=1, dtype=np.int64)
        rows_of = np.arange(lo, hi) // row_block
        out[rows_of[0] : rows_of[-1] + 1] += np.add.reduceat(per_key_block, np.flatnonzero(np.r_[True, np.diff(rows_of) > 0]), axis=0)
        if progress is not None:
            progress(hi, f.q_len)
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
    return f"exact, cell by cell ({mask.why_not_exact})"
