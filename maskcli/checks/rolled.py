"""A sliding or chunked layer whose cache keeps its keys out of position order: how many keys each query sees.

A rolling cache (Gemma 2's HybridCache, a ring buffer) or one that keeps the last W - 1 keys plus the new ones
(Llama 4's HybridChunkedCache, a dynamic sliding cache) holds keys whose columns are not their positions, so
config.py cannot place a window on them. What holds whatever the slots' order: a real query at position p of a
layer whose config states window(W) sees exactly the real tokens of positions p - W + 1 .. p, and one of a layer
chunked by C the real tokens from its chunk's first position to p (chunks counted from the row's first real token,
as config.py's local() is). A query that sees fewer (a mask sliced at the wrong columns hides keys the window
holds) or more (it sees keys the window has left) contradicts the config, the model call's attention_mask and
cache_position, wherever the slots are, as long as the cache holds at least as many keys as the query should see.

Read only where the model call states the query's position (cache_position, input_pos, position_ids, or
`model`'s placing) and each row's padding (its attention_mask or another padding argument; a batch of one row
with none stated is unpadded); a model call that states it keeps no cache (use_cache=False, none handed) holds no
token before its own first one. Where the layer's kind comes from sliding_window or attention_chunk_size alone in a
config that is not transformers' (a hand-written model may keep some layers full with nothing that says which),
only a query that sees too few keys is said.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import _index
from maskcli.checks.context import Run, columns_are_positions, crossing, keep
from maskcli.checks.context import queries as placing
from maskcli.checks.evicted import _named_self
from maskcli.checks.intent import intent
from maskcli.checks.placing import positions_said
from maskcli.checks.real import PADDING_TRUE, stated, trimmed
from maskcli.checks.registry import Rule
from maskcli.text import Finding

POSITIONS = ("cache_position", "input_pos", "position_ids")


def _positions(call, top, run: Run | None = None) -> np.ndarray | None:
    """The queries' positions where the model call (or `model`) states them, or where the call is its site's first
    and its queries are the model call's token ids (a first pass from an empty cache: positions 0 .. Lq - 1); None
    where they would be guessed."""
    if positions_said(call, top, POSITIONS):
        return placing(call, top)
    return np.arange(call.shape[2]) if run is not None and _first_pass(run, call, top) else None


def _self_by_name(call) -> bool:
    """A call set apart as a cross-attention by its lengths alone (more queries than keys) under a module path named a
    self-attention (checks/evicted.py's reading) or by a module whose class is named one (LitGPT's
    `CausalSelfAttention`): a pass over a cache that kept fewer keys than it was handed."""
    reading = crossing(call)
    named = _named_self(call.where) is not None or "selfattention" in call.details.get("class_causal", "").lower()
    return reading.by in ("shape", "none") and call.details.get("kv_source") != "other" and named


def _first_pass(run: Run, call, top) -> bool:
    """The first call of its site, made by a model call handed the queries as its token ids: no earlier call of the
    run wrote this layer's cache, so query i is the model call's token i."""
    arguments = {} if top is None else top.arguments
    given = arguments.get("first_ids")  # (a hand-written forward's first argument: trace/tops.py)
    ids = arguments.get("input_ids", given[1] if isinstance(given, tuple) and len(given) == 2 else None)
    if not (isinstance(ids, np.ndarray) and ids.ndim == 2 and ids.shape[1] == call.shape[2] > 1
            and ids.shape[0] == call.shape[0] and top.first == min(t.first for t in run.tops)):
        return False
    site = run.sites().get(call.where, [])  # (a call set apart as cross is in no site of run.calls: run.cross too)
    return not any(other.index < call.index for other in site) and \
        not any(other.where == call.where and other.index < call.index for other in run.cross)


def _real(top, rows: int, need: int) -> np.ndarray | None:
    """Bool (rows, >= need) real tokens by position, as the model call states them; None where it states none that
    covers `need` positions (a batch of one row that states no padding at all: every token real)."""
    arguments = {} if top is None else top.arguments
    given = arguments.get("attention_mask")
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[1] >= need and given.shape[0] in (1, rows) \
            and given.size and given.min() >= 0 and given.max() <= 1:
        return np.broadcast_to(given != 0, (rows, given.shape[1]))  # (a static cache's mask is max_cache_len wide)
    said = stated(top, rows, need)
    if said is not None:
        return said[0]
    if rows == 1 and given is None and not any(name in arguments for name in PADDING_TRUE):
        return np.ones((1, need), dtype=bool)
    return None


def _expected(real: np.ndarray, own: np.ndarray, kind: str, size: int) -> np.ndarray:
    """Int (rows, Lq): the real tokens a query at each of `own` should see in a window of `size` or a chunk of it."""
    counted = np.concatenate([np.zeros((real.shape[0], 1), np.int64), np.cumsum(real, axis=1)], axis=1)
    if kind == "sliding_attention":
        low = np.broadcast_to(np.maximum(own - size + 1, 0)[None, :], (real.shape[0], own.size))
    else:
        start = real.argmax(axis=1)[:, None]  # chunks from each row's first real token
        low = np.maximum(start + (own[None, :] - start) // size * size, 0)
    return counted[:, own + 1] - np.take_along_axis(counted, low, axis=1)


def miscounted(run: Run) -> list:
    """Each real query of a sliding or chunked layer whose keys are not columns by position against the real tokens
    its window or chunk holds."""
    found, done = [], set()
    if not any(getattr(top, "stated", ()) for top in run.tops):
        return found  # (no config stated anywhere: every call's intent is empty, no layer sliding or chunked)
    for call in [*run.calls, *(call for call in run.cross if _self_by_name(call))]:
        if call.stored is None:
            continue
        stated_for = intent(run, call)
        index = _index(run, call, stated_for) if stated_for else None
        kind = stated_for.kind(index) if stated_for else None
        if kind is None or kind[0] not in ("sliding_attention", "chunked_attention") or stated_for.bidirectional():
            continue
        sliding = kind[0] == "sliding_attention"
        window = stated_for.window() if sliding else None
        chunk = stated_for.get("attention_chunk_size")
        size, name = window if sliding and window else (chunk, "attention_chunk_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            continue
        top = run.top(call)
        counted = trimmed(run, call)
        if counted is None and columns_are_positions(call, top):
            continue  # (config.py places the window on them)
        own = _positions(call, top, run) if counted is None else counted
        if own is None or own.min() < 0:
            continue
        rows = call.shape[0]
        real = _real(top, rows, int(own.max()) + 1)
        if real is not None and top is not None and top.arguments.get("no_cache"):  # (use_cache=False, none handed:
            real = real & (np.arange(real.shape[1]) >= own.min())  # no token before the call's own is held, tops.py)
        if call.shape[2] > call.shape[3] and not _first_pass(run, call, top):
            # (more queries than keys after earlier calls: which slots hold what is unknown, but not how many keys
            # the windows of queries at stated positions need between them)
            over = None if counted is not None or real is None else overrun(
                call, top, own, real, size - (name == "sliding_window_size" and size > 1), sliding, index)
            found += [(call, over)] if over is not None and over.message not in done else []
            done.add(None if over is None else over.message)
            continue
        key = (call.mask, call.shape, tuple(own), None if real is None else real.tobytes())  # (one mask, other places)
        if real is None or key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None:
            continue
        expected = _expected(real, own, kind[0], size)  # (rows, Lq)
        asking = real[:, own]  # a padding query is padding's business
        seen = cells.sum(axis=-1)  # (b, h, Lq) as stored
        # the cache holds at least as many keys as the query should see; or it held them and dropped some from the
        # front (counted): a chunk or window trimmed below its stated size loses keys its query should still see
        held = (expected <= call.shape[3]) | (counted is not None)
        judged = (asking & held)[:, None, :]
        fewer = (seen < expected[:, None, :]) & judged
        more = (seen > expected[:, None, :]) & judged & (not kind[2])
        bad = fewer | more
        if not bad.any():
            continue
        b, h, q = (int(x) for x in np.argwhere(bad)[0])
        p, want, got = int(own[q]), int(expected[b, q]), int(seen[b if seen.shape[0] > 1 else 0, h, q])
        code = "window-miscounted" if sliding else "chunks-miscounted"
        span = f"its window({size})" if sliding else f"its chunk of {size}"
        where = f"layer {index}" if index is not None else call.where
        source = stated_for.said(name)
        why = ("the mask is not placed on the keys the cache holds (its columns are not positions: sliced or rolled "
               "the wrong way?)") if want <= call.shape[3] else (
            f"the cache dropped keys of the {'window' if sliding else 'chunk'} from its front (trimmed below {size} "
            f"tokens, on its buffer's size rather than the tokens it holds?)")
        found.append((call, Finding(code, (
            f"{where}: the query at position {p} of batch row {b} sees {got} of the cache's {call.shape[3]} keys, but "
            f"{span} holds {want} real token{'s' * (want != 1)} ({source}; {_queries(bad)}): {why}"),
            expected=f"{want} keys", source=source)))
    return found


def overrun(call, top, own: np.ndarray, real: np.ndarray, size: int, sliding: bool, index) -> Finding | None:
    """A pass whose real queries, at positions the model call states, need more keys between them than the call
    holds: each sees at least its own key (a window of the smallest reading, SGLang's sliding_window_size counting the
    query or not; a chunk's own key alone), so a cache that holds fewer overwrote or dropped keys of this very pass
    (litgpt#2182: a prefill longer than the ring buffer)."""
    asking = real[:, own]  # (rows, Lq)
    low = np.maximum(own - size + 1, 0) if sliding else own
    covered = np.zeros((real.shape[0], real.shape[1] + 1), np.int64)
    for b in range(real.shape[0]):  # a window's span starts at low, ends past its query: count the real ones covered
        np.add.at(covered[b], low[asking[b]], 1)
        np.add.at(covered[b], own[asking[b]] + 1, -1)
    need = ((np.cumsum(covered, axis=1)[:, :-1] > 0) & real).sum(axis=1)
    k_len = call.shape[3]
    if not (need > k_len).any():
        return None
    b = int(np.argmax(need > k_len))
    q = own[asking[b]]
    where = f"layer {index}" if index is not None else call.where
    arguments = {} if top is None else top.arguments
    said = next((name for name in ("cache_position", "input_pos", "position_ids")
                 if isinstance(arguments.get(name), np.ndarray)), "placed by maskcli model")
    return Finding("window-miscounted", (
        f"{where}: the {int(asking[b].sum())} real queries of batch row {b} (positions {int(q.min())} .. {int(q.max())}, "
        f"{said}) need {int(need[b])} keys between them, each at least its own, but the cache holds {k_len}: a pass "
        f"longer than the cache's buffer overwrote (or dropped) keys its own earlier queries still see (prefill in "
        f"chunks no longer than the buffer?)"), expected=f"{int(need[b])} keys", source=said)


def _queries(bad: np.ndarray) -> str:
    count = int(bad.any(axis=1).sum())
    return f"{count} such {'query' if count == 1 else 'queries'}"


RULES = (
    Rule("window-miscounted", "wrong", "steps", "a sliding layer over a rolled or trimmed cache whose query sees more "
         "or fewer keys than the real tokens of the window its config states", miscounted),
    Rule("chunks-miscounted", "wrong", "steps", "a chunked layer over a trimmed cache whose query sees more or fewer "
         "keys than the real tokens of its chunk (attention_chunk_size)", miscounted),
)
