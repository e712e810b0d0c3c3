"""The page map of a batch: per logical block its physical page, fill, and whether it is shared, null, read or written.

Everything is one array over the batch's CSR page list (O(pages)), vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.serve.batch import ServeBatch


@dataclass(frozen=True, eq=False)
class PageMap:
    owner: np.ndarray  # request of each entry of batch.pages
    column: np.ndarray  # its logical block
    fill: np.ndarray  # keys on it (page_size for a full block)
    read: np.ndarray  # some query of its request reads it (not wholly before a window or chunk)
    null: np.ndarray  # the engine's null page
    shared: np.ndarray  # read by more than one request
    written: np.ndarray  # this step writes new tokens on it


def read_range(b: ServeBatch) -> tuple[np.ndarray, np.ndarray]:
    """Per request the table columns its queries read, [first, end): a window or chunk cuts the start."""
    lo = np.zeros(b.requests, np.int64)
    q_start = np.maximum(b.q_start, 0)
    if b.window is not None and b.cascade is None:
        lo = np.maximum(q_start - b.window + 1, 0)
    if b.chunk is not None:
        lo = q_start // b.chunk * b.chunk
    return b.starts + lo, b.starts + b.seq_lens


def page_map(b: ServeBatch) -> PageMap:
    ps = max(b.page_size, 1)
    owner = np.repeat(np.arange(b.requests), np.diff(b.page_indptr))
    column = np.arange(b.pages.size) - b.page_indptr[owner]
    end = (b.starts + b.seq_lens)[owner]
    fill = np.clip(end - column * ps, 0, ps)
    first, _ = read_range(b)
    read = (column + 1) * ps > first[owner]
    null = b.pages == b.null_page if b.null_page is not None else np.zeros(b.pages.size, bool)
    real = read & ~null
    pairs = np.unique(np.stack([b.pages[real], owner[real]]), axis=1) if real.any() else np.zeros((2, 0), np.int64)
    ids, readers = np.unique(pairs[0], return_counts=True)
    shared = real & np.isin(b.pages, ids[readers > 1])
    if b.write_slots is not None:
        slots = b.write_slots[b.write_slots >= 0]
        written = np.isin(b.pages, np.unique(slots // ps)) & ~null
    else:  # the kernel appends at each request's new positions
        written = (column + 1) * ps > (b.starts + np.maximum(b.q_start, 0))[owner]
        written = np.isin(b.pages, b.pages[written])
    return PageMap(owner, column, fill, read, null, shared, written)
