"""Real queries that see keys whose K and V are exactly zero at an edge of the keys: padding the data itself states.

A key that is zero in every head and dimension of both K and V is no token (trace/zerokv.py records them at each SDPA
call), nor one whose K and V are each one nonzero value throughout (trace/fillkv.py: `torch.full(..., 7.0)`'s slots
that nobody wrote; vllm#47926's DFlash context-KV buffer, attended whole on a prefix-cache hit): it is a buffer row nobody wrote, or a padding position whose input was zeros under bias-free projections. Its
score is 0 and its value 0, so every real query that sees it gives it weight exp(0 - max) and averages zeros into
its output. Where such keys make a run of two or more at the start or the end of a batch row's keys (the shape
padding takes), that row holds real keys too, and a query that is not zero itself sees one of them, the mask lets a
real token attend what the data states is padding: wrong.

- whisper.cpp#3941: the encoder's and the cross-attention's K/V are views of buffers GGML_PAD(n_ctx, 256) rows long,
  only n_ctx of them written, and flash attention is given no mask: 216 zero rows at the end of 256 keys are seen.
- LLaVA#1720: the spliced image+text embeddings are re-padded on the left with zeros and the rebuilt mask dropped, so
  the first layer's bias-free K/V of the padding are zero and the causal queries after them see them.

Quiet where the mask hides those keys (the fixes: whisper.cpp's -inf over [n_ctx, n_ctx_pad), LLaVA's causal &
padding mask), where only queries that are zero themselves see them (a right-padded causal batch: padding queries
only; a finished row of a batched generate, fed pad tokens, whose query is the pad), where the zeros are one key
alone (x-transformers' `add_zero_kv`, a learned null key initialised to zero) or every key of the row, and where they
lie between real keys (not padding's shape), where the query is padding itself (checks/real.py: a left-padded prompt's
padding queries, whose rows transformers unmasks whole so that they give no NaN), and where the model call states outright (its attention_mask, its
lengths) that those keys are real tokens: the program's word over the values' (a tiny vision-language model's image
tokens whose features are zero, Gemma 3's under generate, are tokens).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row, resolve, stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

RUN = 2  # zero keys in a row at an edge read as padding (one alone: a null key)


def _real(zero_q: list, q_len: int) -> np.ndarray:
    """Bool (Lq,): the queries not zero themselves, from their zero spans."""
    real = np.ones(q_len, dtype=bool)
    for start, end in zero_q:
        real[start:end] = False
    return real


def zero_keys_seen(run: Run) -> list:
    """(call, Finding) for a call whose real queries see an edge run of keys zero in K and V (the data's padding)."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:
        table = call.details.get("zero_kv")
        if not table or (call.where, call.shape) in done:
            continue
        cells = keep(call)
        rows, _, q_len, k_len = call.shape
        if cells is None or cells.shape[0] not in (1, rows) or len(table["left"]) not in (1, rows):
            continue
        said = stated(run.top(call), rows, k_len)
        tokens = said[0] if said is not None and said[2] else None  # (the real tokens the model call states outright)
        placed = None  # (B, Lq) real queries (checks/real.py), read once a row has zero keys at an edge
        bounds = table.get("keys")  # (each row's keys some query keeps, where the runs were read from their edges)
        for b in range(rows):
            left, right = table["left"][b % len(table["left"])], table["right"][b % len(table["right"])]
            zero_q = table["zero_q"][b % len(table["zero_q"])] if table["zero_q"] else []
            lo, hi = bounds[b % len(bounds)] if bounds else (0, k_len)
            if left >= hi - lo or zero_q is None or (left < RUN and right < RUN):
                continue  # (every key zero: no padding's shape; too many zero query spans: left unread)
            padding = np.zeros(k_len, dtype=bool)
            if left >= RUN:
                padding[lo:lo + left] = True
            if right >= RUN:
                padding[hi - right:hi] = True
            if tokens is not None:
                padding &= ~tokens[b % tokens.shape[0]]  # (the keys the program states are tokens are tokens)
            real = _real(zero_q, q_len) if len(zero_q) else np.ones(q_len, dtype=bool)
            if placed is None:
                placed = resolve(call, run.top(call), by_row(cells, max(cells.shape[0], rows))).queries
            real = real & placed[b % placed.shape[0]]  # (a padding query's row, unmasked whole on purpose: not judged)
            seen = cells[b % cells.shape[0]].any(axis=0) & real[:, None] & padding[None, :]  # (Lq, Lk)
            if not seen.any():
                continue
            q, k = (int(i) for i in np.argwhere(seen)[0])
            keys = [int(i) for i in np.flatnonzero(padding)]
            done.add((call.where, call.shape))  # (each layer's and step's shape said once)
            fill = _fill(table, left, right, k, lo)
            found.append((call, Finding("zero-keys-seen", (
                f"query {q} of batch row {b} (not zero itself) sees key {k}, one of keys {spans(keys)} whose K and V "
                + (f"are exactly zero in every head: no token (an unwritten buffer row, or padding whose input was "
                   f"zeros); " if fill is None else
                   f"are one value in every head and dimension (K {fill[0]:g}, V {fill[1]:g}): no token, a buffer's "
                   f"fill nobody wrote; ")
                + f"{int(seen.any(axis=1).sum())} of this row's real queries give them weight and average "
                f"their {'zeros' if fill is None else 'fill'} in (hide them in the mask: -inf / False over those keys)"),
                expected=f"keys {spans(keys)} of batch row {b} hidden from every real query",
                source="the call's own K and V: " + ("zero rows" if fill is None else "rows of one fill value")
                + " at an edge of the keys", cell=(b, q, k))))
            break
        if table.get("heads") and (call.where, call.shape) not in done:
            found += _in_heads(run, call, table, cells, tokens)
            done.add((call.where, call.shape))
    return found


def _fill(table: dict, left: int, right: int, k: int, lo: int) -> list | None:
    """[K's, V's] fill of the edge run key `k` is in, where trace/fillkv.py read the run as one nonzero value's
    (its table's "fill"); None where it is zeros."""
    fills = table.get("fill")
    if not fills:
        return None
    return fills["left"] if left >= RUN and lo <= k < lo + left and fills.get("left") else fills.get("right")


def _in_heads(run: Run, call, table: dict, cells: np.ndarray, tokens) -> list:
    """Real queries of a head that see an edge run of keys zero in that head's K and V alone (trace/zerokv.py's
    "heads": a cache that pads each head's kept keys to the longest head's), the other heads' keys there real."""
    rows, heads, q_len, k_len = call.shape
    placed = resolve(call, run.top(call), by_row(cells, max(cells.shape[0], rows))).queries
    bounds = table.get("keys")
    for b in range(rows):
        lo, hi = bounds[b % len(bounds)] if bounds else (0, k_len)
        zero_q = table["zero_q"][b % len(table["zero_q"])] if table["zero_q"] else []
        if zero_q is None:
            continue
        real = (_real(zero_q, q_len) if len(zero_q) else np.ones(q_len, dtype=bool)) & placed[b % placed.shape[0]]
        for h, left, right in table["heads"][b % len(table["heads"])]:
            padding = np.zeros(k_len, dtype=bool)
            padding[lo:lo + left] = left >= RUN
            padding[hi - right:hi] = right >= RUN
            if tokens is not None:
                padding &= ~tokens[b % tokens.shape[0]]
            seen = cells[b % cells.shape[0], h % cells.shape[1]] & real[:, None] & padding[None, :]
            if h >= heads or not seen.any():
                continue
            q, k = (int(i) for i in np.argwhere(seen)[0])
            keys = [int(i) for i in np.flatnonzero(padding)]
            return [(call, Finding("zero-keys-seen", (
                f"query {q} of batch row {b} (not zero itself) sees key {k} in head {h}, one of keys {spans(keys)} "
                f"whose K and V are exactly zero in that head, where other heads hold real keys: a head's keys padded "
                f"with zeros to the longest head's, given weight and averaged in (hide them in that head's mask)"),
                expected=f"keys {spans(keys)} of batch row {b} hidden from head {h}'s real queries",
                source="the call's own K and V: one head's zero rows at an edge of the keys", cell=(b, q, k)))]
    return []


RULES = (
    Rule("zero-keys-seen", "wrong", "call", "real queries that see a run of keys at an edge of the keys whose K and V "
         "are exactly zero (an unwritten buffer row, zero padding): whisper.cpp#3941's K/V padded to 256 rows with "
         "no mask, LLaVA#1720's re-padded embeddings with the rebuilt mask dropped", zero_keys_seen),
)
