"""The page map of a serving batch: per logical block its physical page, fill, and whether it is shared, null, read or
written: what serve's page rules (serve.py, servesteps.py) read and serve's views draw.

Everything is one array over the batch's CSR page list (O(pages)), vectorised. A batch is maskcli.serve.batch.ServeBatch,
taken as it comes (this package sits below serve/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class PageMap:
    owner: np.ndarray  # request of each entry of batch.pages
    column: np.ndarray  # its logical block
    fill: np.ndarray  # keys on it (page_size for a full block)
    read: np.ndarray  # some query of its request reads it (not wholly before a window or chunk)
    null: np.ndarray  # the engine's null page
    shared: np.ndarray  # read by more than one request
    written: np.ndarray  # this step writes new tokens on it
    distinct: int  # physical pages the batch reads (the null page aside)


def read_range(b) -> tuple[np.ndarray, np.ndarray]:
    """Per request the table columns its queries read, [first, end): a window or chunk cuts the start."""
    lo = np.zeros(b.requests, np.int64)
    q_start = np.maximum(b.q_start, 0)
    if b.window is not None and b.cascade is None:
        lo = np.maximum(q_start - b.window + 1, 0)
    if b.chunk is not None:
        lo = q_start // b.chunk * b.chunk
    return b.starts + lo, b.starts + b.seq_lens


def distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values by one sort (numpy's unique hashes, several times slower on 500k page ids)."""
    ordered = np.sort(values)
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])] if ordered.size else ordered


def member(values: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """np.isin for page ids: a lookup table where the ids are small enough, without a sort."""
    if values.size == 0 or chosen.size == 0:
        return np.zeros(values.shape, bool)
    top = int(max(values.max(), chosen.max()))
    if values.min(initial=0) < 0 or chosen.min(initial=0) < 0 or top > (1 << 27):
        return np.isin(values, chosen)
    table = np.zeros(top + 1, bool)
    table[chosen] = True
    return table[values]


def page_map(b) -> PageMap:
    """The batch's page map, computed once per batch (the rules and the views share it)."""
    cached = b.__dict__.get("_page_map")
    if cached is None:
        cached = _page_map(b)
        object.__setattr__(b, "_page_map", cached)
    return cached


def _page_map(b) -> PageMap:
    ps = max(b.page_size, 1)
    owner = np.repeat(np.arange(b.requests), np.diff(b.page_indptr))
    column = np.arange(b.pages.size) - b.page_indptr[owner]
    end = (b.starts + b.seq_lens)[owner]
    fill = np.clip(end - column * ps, 0, ps)
    first, _ = read_range(b)
    read = (column + 1) * ps > first[owner]
    null = b.pages == b.null_page if b.null_page is not None else np.zeros(b.pages.size, bool)
    real = read & ~null
    # (page, request) pairs once each, as one sorted int64 key: a page read by two requests appears twice
    pages = distinct(b.pages[real] * max(b.requests, 1) + owner[real]) // max(b.requests, 1)
    again = np.concatenate([[False], pages[1:] == pages[:-1]]) if pages.size else np.zeros(0, bool)
    ids = pages[~again]
    shared = real & member(b.pages, pages[again])
    if b.write_slots is not None:
        slots = b.write_slots[b.write_slots >= 0]
        written = member(b.pages, slots // ps) & ~null
    else:  # the kernel appends at each request's new positions
        written = (column + 1) * ps > (b.starts + np.maximum(b.q_start, 0))[owner]
        written = member(b.pages, b.pages[written])
    return PageMap(owner, column, fill, read, null, shared, written, int(ids.size))
