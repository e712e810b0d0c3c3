"""A dense batch of sets (or graphs) whose padded elements the attention over it sees.

PyG states which set each element is of in its batch vector (`batch`, or an aggregation's `index`: 0, 0, 0, 1, 1,
...; trace/held.py reads it from the program's frames, kind "graphs"), and `to_dense_batch` lays set g's n_g elements
first in row g of a (G, N) batch, N the largest set, zeros after them. So a call over G batch rows (or G x heads, the
heads folded onto the batch axis either way: `torch.cat(x.split(d, 2), 0)` or `repeat_interleave`) of exactly N keys,
the sets not all of one size, is attention over that dense batch, and the keys n_g .. N - 1 of row g are padding the
program itself states. A real query (q < n_g where the call is a self-attention over the same elements; every query,
a pooling seed, where its queries are not the keys) that sees one of them, while it sees a real key, is *wrong*: a
set's output then depends on the size of the largest set batched with it (pyg-team/pytorch_geometric#6338:
SetTransformerAggregation's `x, _ = self.to_dense_batch(...)` threw the mask away, so SAB and PMA attended the zero
rows). Said only where every reading of the folded heads sees padding at that cell. Quiet: the mask handed on
(`key_padding_mask=~mask`), sets of one size, one set (an all-zero vector is no batch vector), calls of other key
counts (the pooled seeds' self-attention), and padded query rows.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _rows(batch_rows: int, sets: int) -> list[np.ndarray]:
    """Each reading of `batch_rows` rows as the sets: as they are, or with heads folded in tiled or interleaved."""
    if batch_rows == sets:
        return [np.arange(sets)]
    if batch_rows % sets:
        return []
    heads = batch_rows // sets
    return [np.arange(batch_rows) % sets, np.arange(batch_rows) // heads]


def _padding(call, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Bool (b, 1, Lq, Lk): the cells of real queries on keys that `counts` (set of each batch row: `rows`) pads."""
    q_len, k_len = call.shape[2], call.shape[3]
    real = counts[rows]  # (b,)
    keys = np.arange(k_len)[None, :] >= real[:, None]  # (b, Lk) padding keys
    if q_len == k_len:
        queries = np.arange(q_len)[None, :] < real[:, None]  # (b, Lq): a self-attention's padded queries left out
    else:
        queries = np.ones((len(rows), q_len), dtype=bool)
    return (queries[:, :, None] & keys[:, None, :])[:, None]


def padding_attended(run: Run) -> list:
    """Calls over a dense batch of the sets a held batch vector states whose real queries see a set's padding."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked, *run.cross]:
        helds = [held for held in call.details.get("held_padding") or () if held["kind"] == "graphs"]
        if not helds or call.stored is None:
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = _finding(call, helds)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, helds: list) -> Finding | None:
    """The finding of one call against each batch vector it holds (the first seen through), or None."""
    b_len, k_len = call.shape[0], call.shape[3]
    for held in helds:
        counts = np.bincount(held["rows"])
        readings = _rows(b_len, len(counts))
        if int(counts.max()) != k_len or counts.min() == counts.max() or not readings:
            continue
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, b_len):
            continue
        cells = np.broadcast_to(cells, (b_len, *cells.shape[1:]))
        bad = None
        for rows in readings:
            real_keys = (np.arange(k_len)[None, :] < counts[rows][:, None])[:, None, None, :]
            here = cells & _padding(call, counts, rows) & (cells & real_keys).any(axis=-1, keepdims=True)
            bad = here if bad is None else bad & here
        if bad is None or not bad.any():
            continue
        b, h, q, k = (int(x) for x in np.argwhere(bad)[0])
        g = int(readings[0][b])
        said = f"{held['name']} in {held['where']}"
        return Finding("set-padding-attended", (
            f"{said} puts {int(counts.sum())} elements in {len(counts)} sets of {', '.join(map(str, counts.tolist()))}, "
            f"a dense batch of {k_len} keys a set: batch row {b} (set {g}, {int(counts[g])} real) query {q} sees key {k}, "
            f"a padded slot ({int(bad.sum())} such cells): the dense batch's mask was not handed to the attention"),
            expected=f"keys < the set's size, from {held['name']}", source=said, cell=(b, h, q, k))
    return None


RULES = (
    Rule("set-padding-attended", "wrong", "call", "a real element of a dense batch of sets (to_dense_batch) that "
         "sees the padded slots of its set, the sets stated by the batch vector the program's frames hold",
         padding_attended),
)
