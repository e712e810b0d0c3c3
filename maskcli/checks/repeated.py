"""Two real tokens of one sequence that the multimodal rope ids place at the same position, one seeing the other.

Qwen2-VL's rope ids (C, B, L: t, h, w, or transformers' 4 rows with the text row first) give every token of a sample
a place of its own: text counts on one per token in every row, an image's tokens differ in h or w, and the next image
or text counts on from the largest before it. Two real tokens of one sequence (the later sees the earlier in the
kernel's mask, no restart at 0 between them: documents-leak's packing) at the same ids in every row were not counted
over the sample's own tokens: `get_rope_index` keeps the tokens where the mask it is handed is 1 and fills the others
with 1, so handed a mask that is not the batch's padding (the pads' own mask, `target == pad`: Pai-Megatron-Patch#448;
Megatron's 4-D True = masked, whose `.any(-1)` calls an unpadded row's last token padding: Megatron-Bridge#2582) it
leaves real tokens at the 1 it fills padding with.

The ids are the model call's (`position_ids` of 3 or 4 rows: trace/tops.py) or held by a function on the stack
(`position_ids` computed inside the model's forward: trace/held.py, kind "mrope"). The real tokens are those the
run states: a token that sees itself in the kernel's mask, the model call's 2-D attention_mask, and the padding of its
input ids (a run of one id found nowhere else at the rows' ends: checks/padids.py). Where none of them states any
padding, a token that shares its ids with its neighbour (a run of filler, as padding is) is not judged. Read on square
self-attention calls from position 0 whose keys are the ids' tokens.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep, queries
from maskcli.checks.padids import id_padding
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _rope(call, top) -> tuple[np.ndarray, str] | None:
    """(C, B, L) multimodal rope ids of the call and where they were read: the model call's, else a frame's."""
    rope = None if top is None else top.arguments.get("mrope_position_ids")
    if isinstance(rope, np.ndarray) and rope.ndim == 3 and rope.shape[0] in (3, 4):
        return rope.astype(np.int64), f"position_ids of {top.where}"
    for held in call.details.get("held_mrope") or ():
        if held["rows"].shape[2] == call.shape[3]:
            return held["rows"], f"{held['name']} in {held['where']}"
    return None


def ids_padding(tokens: np.ndarray) -> np.ndarray | None:
    """Bool (B, L) real tokens of token ids whose rows are padded with one id found nowhere else: padids.id_padding's
    reading (one row unpadded), or every row ending in a run of that id, two long at least, of different lengths (a
    batch padded to a bucket)."""
    reading = id_padding(tokens)
    if reading is not None:
        return reading[0]
    if tokens.ndim != 2 or tokens.shape[0] < 2 or tokens.shape[1] < 3 or len(np.unique(tokens[:, -1])) != 1:
        return None
    same = tokens == tokens[0, -1]
    run = np.argmax(~same[:, ::-1], axis=1)
    real = np.arange(tokens.shape[1])[None, :] < (tokens.shape[1] - run)[:, None]
    if run.min() < 2 or len(set(run.tolist())) < 2 or not real.any(axis=1).all() or same[real].any():
        return None
    return real


def _real(call, top, seen: np.ndarray) -> tuple[np.ndarray, bool]:
    """(bool (B, L) real tokens, whether any statement of the run calls some token padding)."""
    rows, length = seen.shape[0], seen.shape[2]
    real = seen[:, np.arange(length), np.arange(length)].copy()  # (a token that sees itself)
    arguments = {} if top is None else top.arguments
    mask = arguments.get("attention_mask")
    if isinstance(mask, np.ndarray) and mask.ndim == 2 and mask.shape[1] == length and mask.shape[0] in (1, rows):
        real &= mask != 0
    for name in ("input_ids", "idx", "tokens"):
        tokens = arguments.get(name)
        if isinstance(tokens, np.ndarray) and tokens.shape == (rows, length):
            padded = ids_padding(tokens)
            if padded is not None:
                real &= padded
            break
    return real, not real.all()


def _filler(ids: np.ndarray) -> np.ndarray:
    """Bool (B, L): tokens whose ids (C, B, L) equal those of the token before or after them in every row."""
    same = (ids[:, :, 1:] == ids[:, :, :-1]).all(axis=0)
    out = np.zeros(ids.shape[1:], dtype=bool)
    out[:, 1:] |= same
    out[:, :-1] |= same
    return out


def _pairs(seen: np.ndarray, ids: np.ndarray, real: np.ndarray, restart: np.ndarray) -> tuple[tuple, int] | None:
    """(the first (b, q, k), how many) of the real queries that see an earlier real key of their sequence at the same
    ids; None if none. Only tokens whose ids another real token of the row shares are compared (np.unique, not
    L x L x C)."""
    first, count = None, 0
    for b in range(seen.shape[0]):
        where = np.flatnonzero(real[b])
        if where.size < 2:
            continue
        _, group, sizes = np.unique(ids[:, b, where].T, axis=0, return_inverse=True, return_counts=True)
        group = group.reshape(-1)
        shared, labels = where[sizes[group] > 1], group[sizes[group] > 1]
        q, k = shared[:, None], shared[None, :]
        one = (labels[:, None] == labels[None, :]) & (q > k) & seen[b][q, k] & (restart[b][q] == restart[b][k])
        if one.any():
            count += int(one.sum())
            if first is None:
                at = np.argwhere(one)[0]  # (row-major, `shared` in token order: the first query, then its key)
                first = (b, int(shared[at[0]]), int(shared[at[1]]))
    return None if first is None else (first, count)


def repeated(run: Run) -> list:
    """A real query that sees a real key of its own sequence at the same multimodal rope ids as its own."""
    found, done = [], {}
    for call in run.calls:
        top = run.top(call)
        got = _rope(call, top)
        rows = call.shape[0]
        if got is None or call.stored is None or call.shape[2] != call.shape[3] or cross(call) \
                or got[0].shape[1] not in (1, rows) or got[0].shape[2] != call.shape[3] or queries(call, top)[0] != 0:
            continue
        (ids, said), key = got, (call.mask, call.shape, got[0].tobytes())
        if key not in done:
            done[key] = _finding(call, top, ids, said)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, top, ids: np.ndarray, said: str) -> Finding | None:
    """positions-repeated's finding on one call's mask and rope ids (C, B or 1, L), or None."""
    cells, rows = keep(call), call.shape[0]
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    seen = np.broadcast_to(cells.any(axis=1), (rows, *cells.shape[2:]))
    ids = np.broadcast_to(ids, (ids.shape[0], rows, ids.shape[2]))
    real, stated = _real(call, top, seen)
    if not stated:
        real = real & ~_filler(ids)
    restart = np.cumsum((ids == 0).all(axis=0) & real, axis=1)  # (a packed sample's first token: a new sequence)
    pairs = _pairs(seen, ids, real, restart)
    if pairs is None:
        return None
    (b, q, k), count = pairs
    place = tuple(int(v) for v in ids[:, b, q])
    return Finding("positions-repeated", (
        f"batch row {b}: query {q} sees key {k}, both real tokens of one sequence, and {said} place both at {place} "
        f"({count} such cells): the rope ids were not counted over this row's real tokens (the rope index handed "
        f"another mask than the batch's padding, filling real tokens as padding?)"),
        expected="each real token of a sequence at rope ids of its own", source=said, cell=(b, q, k))


RULES = (
    Rule("positions-repeated", "wrong", "call", "a real query that sees a real key of its own sequence placed at the "
         "same multimodal rope ids (t, h, w) as itself: the rope index computed from a mask other than the batch's "
         "padding", repeated),
)
