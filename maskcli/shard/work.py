"""Each rank's part of a mask under a layout: its visible cells and FLOPs, the imbalance, and its ring steps.

Exact from the mask's key intervals at any length: a rank's cells are sums of per-row counts over its pieces,
and the cells rank r's query rows see of rank s's keys (the ring-step grid) come from the interval ends, each
looked up in the key side's pieces: O(rows x intervals + pieces x ranks), never rows x keys.

Ring attention (PyTorch's _templated_ring_attention) gives rank r at step i the keys of rank (r - i) mod N
(_is_causal_behavior: `source_rank = (rank - i) % world_size`, _context_parallel/_attention.py:96); a step whose
block is empty is one the rank may skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.errors import MaskError
from maskcli.formats.base import rows_of
from maskcli.intervals import Intervals
from maskcli.mask import Mask
from maskcli.shard.layouts import Layout

EMPTY, PARTIAL, FULL = 0, 1, 2
GRID_LIMIT = 1 << 25  # key pieces x ranks in the ring-step grid's table of counts


@dataclass(frozen=True, eq=False)
class Split:
    """One mask under one layout: per-rank work and, for ring layouts, the (N, N) grid of cells."""

    mask: Mask
    layout: Layout
    cells: np.ndarray  # int64 (N,): visible cells of each rank's query rows (every key), one head
    grid: np.ndarray | None  # int64 (N, N): cells of rank r's rows against rank s's keys; None for ulysses
    head_dim: int = 128

    @property
    def ranks(self) -> int:
        return self.layout.ranks

    def work(self) -> np.ndarray:
        """Visible cells x heads each rank computes (float64: Ulysses' heads may not divide evenly)."""
        heads = self.mask.heads
        if self.layout.heads is not None:  # every rank: all the cells, for its heads
            return float(self.cells.sum()) * np.asarray(self.layout.heads, dtype=np.float64)
        return self.cells.astype(np.float64) * heads

    def flops(self) -> np.ndarray:
        """Forward attention FLOPs per rank: 2 matmuls (QK^T and PV), 2 FLOPs a multiply-add, head_dim each."""
        return 4.0 * self.head_dim * self.work()

    def ratios(self) -> np.ndarray:
        work = self.work()
        mean = work.mean()
        return work / mean if mean > 0 else np.ones_like(work)

    @property
    def imbalance(self) -> float:
        """max / mean of the work: 1.0 is perfect; 2.0 means the slowest rank does twice the average."""
        return float(self.ratios().max())

    def categories(self) -> np.ndarray | None:
        """int8 (N, N) of EMPTY, PARTIAL, FULL: rank r's rows against rank s's keys."""
        if self.grid is None:
            return None
        tokens = self.layout.tokens()
        whole = np.outer(tokens, tokens)
        out = np.full(self.grid.shape, PARTIAL, dtype=np.int8)
        out[self.grid == 0] = EMPTY
        out[(self.grid == whole) & (whole > 0)] = FULL
        return out

    def steps(self) -> np.ndarray | None:
        """int8 (N, N): rank r's block at ring step i (keys of rank (r - i) mod N)."""
        cats = self.categories()
        if cats is None:
            return None
        r = np.arange(self.ranks)[:, None]
        return cats[r, (r - np.arange(self.ranks)[None, :]) % self.ranks]


def intervals_of(mask: Mask) -> Intervals:
    """The mask's key intervals: its own where they are few, else those of a file's cells (already dense in
    memory: each row's runs, vectorised over the whole tensor)."""
    if mask.exact:
        return mask.intervals()
    keep = mask.keep[0, 0]
    rows, keys = keep.shape
    steps = np.diff(np.pad(keep, ((0, 0), (1, 1))).astype(np.int8), axis=1)
    row_s, col_s = np.nonzero(steps == 1)
    _, col_e = np.nonzero(steps == -1)  # row-major: each row's ends in the order of its starts
    return rows_of([(row_s, col_s, col_e)], rows, 0, keys)


def touched_blocks(intervals: Intervals, length: int, block: int) -> np.ndarray:
    """Per query block of `block` rows, the key blocks its rows see some of (FlexAttention's partial + full
    kv_num_blocks): int64 (ceil(length / block),), exactly.

    Each row interval becomes a range of key blocks; a query block's count is the size of the union of its rows'
    ranges. All ranges are sorted once, each block's shifted past the last's (so that a running maximum of the
    ends never carries from one block into the next), and each range adds what lies past the ends before it."""
    n_q = -(-length // block)
    s = np.broadcast_to(intervals.starts[0], (length, intervals.per_row))
    e = np.broadcast_to(intervals.ends[0], s.shape)
    real = s < e
    shift = np.broadcast_to((np.arange(length) // block)[:, None], s.shape)[real]
    span = -(-(intervals.k_end - intervals.k_start) // block) + 1
    lo = (s[real] - intervals.k_start) // block + shift * span
    hi = (e[real] - 1 - intervals.k_start) // block + 1 + shift * span
    order = np.argsort(lo, kind="stable")
    lo, hi, shift = lo[order], hi[order], shift[order]
    reach = np.maximum.accumulate(hi)
    before = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    new = np.clip(hi - np.maximum(lo, before), 0, None)
    return np.bincount(shift, weights=new, minlength=n_q).astype(np.int64)


def row_counts(intervals: Intervals, rows: int) -> np.ndarray:
    """Visible keys per query row, int64 (rows,), exactly (batch row 0)."""
    return np.broadcast_to(intervals.counts()[0], (rows,)).astype(np.int64)


def check_shardable(mask: Mask) -> None:
    """Context parallelism splits one self-attention sequence: queries and keys are the same positions 0..L-1."""
    f = mask.frame
    if (f.q_start, f.k_start, f.q_len) != (0, 0, f.k_len):
        raise MaskError(f"{mask.title}: shard splits self-attention over one sequence, but its queries are {f.q_start}..{f.q_end - 1} "
                        f"and keys {f.k_start}..{f.k_end - 1}: drop --offset, --kv-start and --kv-len")
    if mask.batch > 1:
        raise MaskError(f"{mask.title} has {mask.batch} batch rows: shard splits one sequence; give one row (a packed batch is one row of documents)")
    if not mask.exact and mask.keep is None:
        raise MaskError(f"{mask.title}: {mask.why_not_exact}, so its keys are not a few intervals per row and shard cannot split it exactly")
    if mask.keep is not None and mask.keep.shape[1] > 1:
        raise MaskError(f"{mask.title} holds {mask.keep.shape[1]} heads: context parallelism splits tokens the same way for every head; give one head's mask")


def split(mask: Mask, layout: Layout, head_dim: int = 128) -> Split:
    """Every rank's cells and the ring-step grid, exactly."""
    check_shardable(mask)
    if layout.length != mask.frame.q_len:
        raise MaskError(f"the layout covers {layout.length:,} tokens but the mask has {mask.frame.q_len:,}: give --len {layout.length}")
    intervals = intervals_of(mask)
    counts = row_counts(intervals, mask.frame.q_len)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    real = layout.real
    per_piece = prefix[layout.start[real] + layout.size[real]] - prefix[layout.start[real]]
    cells = np.bincount(layout.rank[real], weights=per_piece, minlength=layout.ranks)
    cells = np.rint(cells).astype(np.int64)
    grid = None if layout.heads is not None else ring_grid(intervals, layout)
    return Split(mask, layout, cells, grid, head_dim)


def ring_grid(intervals: Intervals, layout: Layout) -> np.ndarray:
    """int64 (N, N): cells of rank r's query rows against rank s's keys.

    For a row interval [a, b), the keys rank s holds in it are C_s(b) - C_s(a), C_s(x) the positions below x
    that s holds. Over the key pieces sorted by position (one period of them for a periodic layout), C_s(x) =
    before[j, s] + (x - edge[j]) where x falls in piece j and s holds it: the interval ends are grouped by
    (row's rank, piece) and the table `before` is multiplied in once.
    """
    n = layout.ranks
    real = layout.real
    starts, sizes, owners = layout.start[real], layout.size[real], layout.rank[real]
    period = layout.period if layout.period is not None and layout.period < layout.length else None
    if period is not None:
        inside = starts < period
        starts, sizes, owners = starts[inside], sizes[inside], owners[inside]
    order = np.argsort(starts, kind="stable")
    edge, size, own = starts[order], sizes[order], owners[order]
    if edge.size * n > GRID_LIMIT:
        raise MaskError(f"the layout has {edge.size:,} runs of positions: too many for the ring-step grid over {n} ranks; "
                        "use a layout with longer runs (a block-wise permutation)")
    before = np.zeros((edge.size, n), dtype=np.float64)
    np.add.at(before, (np.arange(edge.size), own), size)
    before = np.cumsum(before, axis=0) - before  # keys each rank holds before piece j
    per_period = before[-1] + np.bincount(own[-1:], weights=size[-1:], minlength=n) if edge.size else np.zeros(n)

    row_owner = layout.owner()
    out = np.zeros((n, n), dtype=np.float64)
    rows = layout.length
    band = max(1, (1 << 21) // max(1, intervals.per_row))
    for lo in range(0, rows, band):  # bands bound the memory of the interval ends at 1M rows
        hi = min(rows, lo + band)
        part = intervals.rows(0, lo, hi)
        s, e = part.starts[0], part.ends[0]
        keep = s < e
        row = np.broadcast_to(row_owner[lo:hi, None], s.shape)[keep].astype(np.int64)
        x = np.concatenate([e[keep], s[keep]])
        sign = np.concatenate([np.ones(row.size), -np.ones(row.size)])
        row = np.concatenate([row, row])
        held = row >= 0
        x, sign, row = x[held], sign[held], row[held]
        laps = x // period if period is not None else np.zeros_like(x)
        inner = x - laps * period if period is not None else x
        j = np.clip(np.searchsorted(edge, inner, side="right") - 1, 0, None)
        a = np.bincount(row * edge.size + j, weights=sign, minlength=n * edge.size).reshape(n, edge.size)
        out += a @ before
        inside_piece = np.clip(inner - edge[j], 0, size[j])  # an end past the last piece counts it whole
        out += np.bincount(row * n + own[j], weights=sign * inside_piece, minlength=n * n).reshape(n, n)
        if period is not None:
            out += np.outer(np.bincount(row, weights=sign * laps, minlength=n), per_period)
    return np.rint(out).astype(np.int64)


def te_cu_seqlens(layout: Layout, doc_sizes: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """TransformerEngine's THD + CP numbers for a head-tail split of documents: (cu_seqlens_padded // cp_size,
    the same on every rank, context_parallel.py:1447), and each rank's cu_seqlens of real tokens
    (get_cu_seqlens_on_cp_rank, context_parallel.py:210: per document, the real tokens of its chunks r and
    2N-1-r). None for a layout that is not TE's split."""
    n = layout.ranks
    sizes = np.asarray(doc_sizes, dtype=np.int64)
    padded = -(-sizes // (2 * n)) * (2 * n)
    local_padded = np.concatenate([[0], np.cumsum(padded)]) // n
    chunk = padded // (2 * n)
    per_rank = []
    for r in range(n):  # N ranks, each vectorised over documents
        first = np.clip(sizes - r * chunk, 0, chunk)
        second = np.clip(sizes - (2 * n - r - 1) * chunk, 0, chunk)
        per_rank.append(np.concatenate([[0], np.cumsum(first + second)]))
    return local_padded, per_rank


def local_cu_seqlens(layout: Layout, doc_starts: np.ndarray) -> list[np.ndarray]:
    """Each rank's cu_seqlens on its own tokens in local order (real tokens only): a new sequence wherever the
    next local token is of another document than the last, as flash_attn_varlen_func or a FlexAttention
    document mask on that rank needs them (pieces are cut at document starts, vectorised)."""
    real = layout.real
    rank, start, size = layout.rank[real], layout.start[real], layout.size[real]
    end = start + size
    first_doc = np.searchsorted(doc_starts, start, side="right") - 1
    last_doc = np.searchsorted(doc_starts, end - 1, side="right") - 1
    parts = last_doc - first_doc + 1  # a piece spanning documents becomes one part per document
    piece = np.repeat(np.arange(start.size), parts)
    doc = np.repeat(first_doc, parts) + (np.arange(piece.size) - np.repeat(np.cumsum(parts) - parts, parts))
    lo = np.maximum(start[piece], doc_starts[doc])
    hi = np.minimum(end[piece], np.append(doc_starts[1:], np.iinfo(np.int64).max)[doc])
    owner = rank[piece]
    new = np.ones(piece.size, dtype=bool)
    new[1:] = (owner[1:] != owner[:-1]) | (doc[1:] != doc[:-1])
    group = np.cumsum(new) - 1
    lengths = np.bincount(group, weights=hi - lo).astype(np.int64)
    group_rank = owner[new]
    out = []
    for r in range(layout.ranks):
        mine = lengths[group_rank == r]
        out.append(np.concatenate([[0], np.cumsum(mine)]))
    return out
