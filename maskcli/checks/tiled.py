"""A call that is one tile of a larger attention (trace/tiled.py's details["tile"]): where its queries, keys and rows are.

A blockwise kernel written in the program (memory-efficient-attention-pytorch's chunked loop, one softmax or one sum of
exponentials per (query chunk, key chunk) pair) runs each tile over a slice of the queries and a slice of the keys: a
tile whose keys all come after its queries is fully masked under a causal mask, one whose keys all come before them
masks nothing, and neither says anything of the whole. Its queries and keys are read at their places in the tensors
they were split from; its rows that see none of its keys see others in other tiles. A call over a slice of a larger
batch (reformer-pytorch's `attn_chunks`, the batch folded with its heads and chunked) holds other rows than the model
call's batch: its row r is not the stated padding's row r.
"""

from __future__ import annotations

import numpy as np


def _spans(call) -> list | None:
    part = call.details.get("tile")
    return part if isinstance(part, (list, tuple)) and len(part) == 3 else None


def positions(call, own: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query positions, key positions) of a call whose queries are a slice of the queries it was split from: each at its
    place there (the query chunk's start, the key chunk's); `own` and `keys` (as placed otherwise) where it is none."""
    part = _spans(call)
    if part is None or call.shape[2] >= part[1][1]:
        return own, keys
    return part[1][0] + np.arange(call.shape[2]), part[2][0] + np.arange(call.shape[3])


def key_tile(call) -> bool:
    """The call's queries and keys are both slices of longer tensors, its keys not where its queries are: the keys its
    rows see no key of are not all the keys those queries have."""
    part = _spans(call)
    return part is not None and call.shape[2] < part[1][1] and call.shape[3] < part[2][1] and (
        part[1][0] != part[2][0] or call.shape[2] != call.shape[3])


def batch_part(call) -> bool:
    """The call's rows are a slice of a larger batch (a chunk of the rows the program holds)."""
    part = _spans(call)
    return part is not None and call.shape[0] < part[0][1]


def chunk_readings(call, top, length: int) -> tuple[list, str, bool, int] | None:
    """([real (rows, length) laid batch-major, laid head-major], source, sure, B) of a call over a chunk of the batch
    folded with its heads (batch_part): the model call's stated padding of B rows, B dividing the whole's rows, laid
    on the chunk's rows at their place in the whole (row n of the whole is sample n // (whole / B), or n % B); None
    where no such B states it."""
    from maskcli.checks.real import stated  # (real.py reads arguments; tiled.py is read by rules it does not need)
    start, total = _spans(call)[0]
    at = start + np.arange(call.shape[0])
    for size in (*range(1, total // 2 + 1), total):  # (B = total: a call over some of the batch's own rows)
        said = stated(top, size, length) if total % size == 0 else None
        if said is not None:
            real = np.broadcast_to(said[0], (size, length))
            return [real[at // (total // size)], real[at % size]], said[1], said[2], size
    return None


def tile_columns(call) -> np.ndarray | None:
    """Int (Lq,): each query's place as a key column of a tile (key_tile): its position in the whole less the key
    chunk's start (below 0 before the tile's first key, past its last after them); None where the call is no tile."""
    if not key_tile(call):
        return None
    part = _spans(call)
    return part[1][0] - part[2][0] + np.arange(call.shape[2])


def hides_only_later(call, cells: np.ndarray) -> bool:
    """A tile (key_tile) whose keep cells (b, h, Lq, Lk) hide only keys after their query, at their places in the whole:
    what a causal mask rebuilt per (query chunk, key chunk) hides there (all of a tile whose keys come after its
    queries), whatever another reading of the tile's cells is named."""
    columns = tile_columns(call)
    if columns is None:
        return False
    at_or_before = np.arange(call.shape[3])[None, :] <= columns[:, None]  # (Lq, Lk)
    return not (~cells & at_or_before).any()
