"""Exact counts of visible cells per block of a mask: from its intervals, or by tiles of cells.

Intervals count a block in O(rows x key blocks); a mask whose intervals are not few (a
tensor, labels that go down) is counted cell by cell, a band of rows at a time, so memory
stays bounded. Either way the count is exact: no block with a visible cell reads as empty.
"""

from __future__ import annotations

import numpy as np

from maskcli.mask import Mask

TILE_CELLS = 1 << 24  # cells per band when counting cell by cell


def edges(length: int, block: int, start: int = 0) -> np.ndarray:
    """Block boundaries start, start+block, ..., start+length (the last block may be shorter)."""
    return np.minimum(np.arange(0, length + block, block, dtype=np.int64), length)[: -(-length // block) + 1] + start


def block_counts(mask: Mask, b: int, h: int, q_edges: np.ndarray, k_edges: np.ndarray) -> np.ndarray:
    """Visible cells per block, int64 (len(q_edges)-1, len(k_edges)-1).

    q_edges are local query rows (0..Lq), k_edges absolute key positions (k_start..k_end).
    """
    if mask.exact:
        return mask.intervals().block_counts(b, q_edges, k_edges)
    out = np.zeros((len(q_edges) - 1, len(k_edges) - 1), dtype=np.int64)
    local_k = np.asarray(k_edges) - mask.frame.k_start
    band = max(1, TILE_CELLS // max(1, mask.frame.k_len))
    block_of_row = np.searchsorted(q_edges, np.arange(q_edges[0], q_edges[-1]), side="right") - 1
    for lo in range(int(q_edges[0]), int(q_edges[-1]), band):
        hi = min(int(q_edges[-1]), lo + band)
        cells = mask.cells(b, h, lo, hi)
        before = np.concatenate([np.zeros((hi - lo, 1), np.int64), np.cumsum(cells, axis=1)], axis=1)
        np.add.at(out, block_of_row[lo - q_edges[0] : hi - q_edges[0]], np.diff(before[:, local_k], axis=1))
    return out


def block_shares(mask: Mask, b: int, h: int, rows: int, cols: int) -> np.ndarray:
    """Share of visible cells (0..1) per block of `rows` queries x `cols` keys, exactly."""
    f = mask.frame
    q_edges = edges(f.q_len, rows)
    k_edges = edges(f.k_len, cols, f.k_start)
    counts = block_counts(mask, b, h, q_edges, k_edges)
    return counts / (np.diff(q_edges)[:, None] * np.diff(k_edges)[None, :])


def how_counted(mask: Mask) -> str:
    """Which exact path counted the cells, in words."""
    if mask.exact:
        return "exact, from key intervals"
    return f"exact, cell by cell ({mask.why_not_exact})"
