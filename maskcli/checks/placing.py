"""Where a call's queries sit among its keys: each query row's absolute position, read off the model call's arguments
(cache_position, input_pos, start_pos, position_ids, ...) and the call's own details (context.py re-exports it: every
rule asks `queries` of context)."""

from __future__ import annotations

import numpy as np

# the int a model call states its first query's position by, where a cache of the program's own is written (Meta's Llama
# forward(tokens, start_pos), Keras-hub's cache_update_index) or a block of queries sits past another's cache (an MTP
# drafter's query_offset, past_key_values_length, seqlen_offset): trace/tops.py keeps them, queries() and rows.py read them
STARTS = ("start_pos", "cache_update_index", "query_offset", "q_offset", "past_key_values_length", "past_length",
          "seqlen_offset", "current_pos")


def real_queries(real: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Bool (rows, Lq): which queries, placed at key positions `own`, sit on a real token of `real` (rows, Lk); a
    query placed outside the keys (before them or past them) is not."""
    length = real.shape[1]
    inside = (own >= 0) & (own < length)
    found = np.zeros((real.shape[0], len(own)), dtype=bool)
    found[:, inside] = real[:, own[inside]]
    return found


def positions_said(call, top, names=("cache_position", "input_pos")) -> bool:
    """`model` placed the call's queries, or the model call states their positions by one of `names` (as many as the
    call's queries)."""
    arguments = {} if top is None else top.arguments
    return call.details.get("queries") is not None or any(
        isinstance(arguments.get(name), np.ndarray) and arguments[name].shape[-1] == call.shape[2] for name in names)


def queries(call, top) -> np.ndarray:
    """The absolute position of each query row: `model`'s placing, the model call's cache_position or input_pos, the
    int its own cache is written at (start_pos, cache_update_index), the last tokens a static cache holds (its slots
    past them unwritten), its position_ids where every batch row counts up by 1 (the furthest row's: a left-padded row
    counts from its first real token; transformers' generate passes position_ids alone), the last slots written of a
    buffer whose last keys are zero in K and V (a static cache of the program's own, trace/zerokv.py), else the end of
    the keys (a cache that keeps every key, the key columns being positions). Read-only: read once per call and top
    while the call's details stay as they are (every rule asks it of every call)."""
    held = _QUERIES.get(id(call))
    if held is not None and held[0] is call and held[1] is top and held[2] == len(call.details):
        return held[3]
    if len(_QUERIES) > 1 << 16:
        _QUERIES.clear()
    found = _queries(call, top)
    found.setflags(write=False)
    _QUERIES[id(call)] = (call, top, len(call.details), found)  # (call and top held: their ids cannot be reused while here)
    return found


_QUERIES: dict[int, tuple] = {}


def queries_stated(call, top) -> bool:
    """Something the run states places the call's queries (what queries() reads before its last guess, the end of the
    keys): maskcli's `model`, the model call's positions or cache offsets, a static buffer's unwritten slots."""
    return _stated(call, top) is not None


def _queries(call, top) -> np.ndarray:
    q_len, k_len = call.shape[2:]
    found = _stated(call, top)
    return np.arange(k_len - q_len, k_len) if found is None else found


def _stated(call, top) -> np.ndarray | None:
    q_len, k_len = call.shape[2:]
    placed = call.details.get("queries")
    if placed is not None:
        return np.arange(placed[0], placed[1])
    arguments = {} if top is None else top.arguments
    for name in ("cache_position", "input_pos"):
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and 1 <= given.ndim <= 2 and given.shape[-1] == q_len \
                and not (np.diff(given.reshape(-1, q_len)[0]) < 0).any():  # (positions that restart: packed documents'
            return given.reshape(-1, q_len)[0].astype(np.int64)  # positions, torchtune's input_pos, not cache slots)
    for name in STARTS:  # the int a cache of the program's own is written at
        start = arguments.get(name)
        if isinstance(start, int) and start + q_len <= k_len:
            return np.arange(start, start + q_len)
    held = arguments.get("cache_length")
    sizes = () if top is None else top.arguments.get("cache_slots", ())
    if isinstance(held, int) and q_len <= held < k_len and sizes:  # a static cache's slots past the written ones
        return np.arange(held - q_len, held)  # (trace/tops.py; a dynamic cache holding fewer as the call ends was
        # compressed by then, a press's eviction in its layers' hooks: kvpress's SnapKV, its keys no slots)
    if isinstance(held, int) and any(held >= size and k_len == size - 1 + q_len for size in sizes):
        return np.arange(held - q_len, held)  # a full static sliding layer's last size - 1 keys and the new ones
        # (cache_utils.py StaticSlidingWindowLayer.update 583-591, 621-624): its columns are not positions
    given = arguments.get("position_ids")
    if isinstance(given, np.ndarray) and 1 <= given.ndim <= 2 and given.shape[-1] == q_len:
        rows = given.reshape(-1, q_len)
        if (np.diff(rows, axis=1) == 1).all():
            return rows[int(rows[:, 0].argmax())].astype(np.int64)
    unwritten = call.details.get("unwritten")  # a static buffer's last slots, zero in K and V: none written yet
    if isinstance(unwritten, int) and 0 < unwritten <= k_len - q_len:  # (trace/zerokv.py)
        return np.arange(k_len - unwritten - q_len, k_len - unwritten)
    return None
