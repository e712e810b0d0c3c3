"""A cross-attention whose queries were unpadded with its keys' padding mask: each batch row keeps as many queries
as its memory has real keys.

A varlen kernel's unpad helper written for self-attention (transformers' `_upad_input`: `attention_mask[:, -q_len:]`
then `unpad_input(query, mask)`) applied to a cross-attention selects the queries by the *key* mask: with an image of
Lq latent queries over a text of Lk padded keys, row b keeps the n_b queries its text mask calls real (those flat
indices, taken from the [B * Lq] queries, may even be another row's), and the rest are dropped, scattered back as
zeros (vllm-project/vllm-omni#5865). What the program states: the layer's forward was handed (B, Lq) queries
(trace/queried.py), and a (B, Lk) padding mask of its keys (trace/held.py), Lk != Lq. Wrong where the calls of one
layer call attend, row by row, exactly [real count of mask[b, -Lq:]] queries over the n_b real keys of row b, fewer
than the Lq queries of some row. Quiet where every row's Lq queries are attended (the fix: queries dense, K/V
unpadded), for self-attention (queries as many as keys: unpadding both is right), and where the segments do not follow
the key mask row by row.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _key_mask(details: dict, batch: int, q_len: int):
    """(n: each row's real keys, cut: each row's query counts a key mask's unpadding keeps, the held reading) of the
    first padding held at the call over B rows that is not the queries' own (a mask as wide as the queries is), with a
    row padded; None where none. `cut` holds, per row, what `unpad_input(query, mask[:, -Lq:])` keeps (transformers'
    `_upad_input`) and what `q[b, :n_b]` keeps (a loop trimming both sides by the key lengths)."""
    for held in details.get("held_padding") or ():
        rows = held.get("rows")
        if held.get("kind") not in ("keep", "pad", "lengths") or not isinstance(rows, np.ndarray) or rows.shape[0] != batch:
            continue
        if held["kind"] == "lengths":
            if rows.ndim != 1 or rows.min() < 1 or rows.min() == rows.max():
                continue
            n = rows.astype(np.int64)
            cuts = (np.minimum(n, q_len),)
        else:
            if rows.ndim != 2 or rows.shape[1] == q_len or rows.shape[1] < 2:
                continue
            real = rows.astype(bool) if held["kind"] == "keep" else ~rows.astype(bool)
            if real.all() or not real.any(axis=1).all():
                continue
            n = real.sum(axis=1)
            cuts = (real[:, -q_len:].sum(axis=1), np.minimum(n, q_len))
        return n, cuts, held
    return None


def _segments(call) -> list[tuple[int, int]]:
    """(queries, keys) of each sequence the call attends: a varlen kernel's from its cu_seqlens (flash_attn's
    `flash_attn_varlen_func`), else one per batch row of its shape."""
    cu_q, cu_k = call.details.get("cu_seqlens_q"), call.details.get("cu_seqlens_k")
    if isinstance(cu_q, list) and isinstance(cu_k, list) and len(cu_q) == len(cu_k) > 1:
        return [(int(b - a), int(d - c)) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    return [(int(call.shape[2]), int(call.shape[3]))] * int(call.shape[0])


def _counts(held: dict) -> list | None:
    """Each row's real tokens in a held padding reading; None where it is no padding of rows."""
    rows = held.get("rows")
    if not isinstance(rows, np.ndarray):
        return None
    if held.get("kind") == "lengths" and rows.ndim == 1:
        return [int(x) for x in rows]
    if held.get("kind") in ("keep", "pad") and rows.ndim == 2:
        real = rows.astype(bool) if held["kind"] == "keep" else ~rows.astype(bool)
        return [int(x) for x in real.sum(axis=1)]
    return None


def _real(held: dict):
    rows = held.get("rows")
    if held.get("kind") not in ("keep", "pad") or not isinstance(rows, np.ndarray) or rows.ndim != 2:
        return None
    return rows.astype(bool) if held["kind"] == "keep" else ~rows.astype(bool)


def _tail(other: dict, keys: dict, q_len: int) -> bool:
    """`other` is the key padding `keys`' last q_len columns (`attention_mask[:, -q_len:]`, the unpad helper's own
    slice, held under another name or frame): the keys' padding again, not the queries' own."""
    mine, theirs = _real(other), _real(keys)
    return mine is not None and theirs is not None and mine.shape == (theirs.shape[0], q_len) \
        and np.array_equal(mine, theirs[:, -q_len:])


def _over(held: dict, q_len: int) -> bool:
    """`held` may be padding of the queries: lengths, or a mask as wide as the queries."""
    real = _real(held)
    return held.get("kind") == "lengths" if real is None else real.shape[1] == q_len


def queries_unpadded_by_keys(run: Run) -> list:
    """The calls of one layer call (same outermost call, same module path, same key mask) whose query segments are
    the key mask's real counts, row by row, where the layer was handed more queries."""
    groups: dict = {}
    for call in sorted((*run.calls, *run.cross, *run.unmasked), key=lambda c: c.index):  # (no mask at all, often)
        given = call.details.get("query_input")
        if not given:
            continue
        found = _key_mask(call.details, int(given[0]), int(given[1]))
        if found is None:
            continue
        key = (id(run.top(call)), call.where, tuple(given), found[0].tobytes(), found[2]["name"])
        groups.setdefault(key, (found, []))[1].append(call)
    results = []
    for (_, _, given, _, _), ((n, cuts, held), calls) in groups.items():
        batch, q_len = given
        segments = [segment for call in calls for segment in _segments(call)]
        cut = next((c for c in cuts if segments == [(int(a), int(k)) for a, k in zip(c, n)]), None)
        if cut is None or cut.sum() >= batch * q_len:
            continue  # (the segments do not follow the key padding row by row, or every query is attended)
        if any(_counts(other) == [int(c) for c in cut] and not _tail(other, held, q_len) and _over(other, q_len)
               for other in calls[0].details.get("held_padding") or () if other is not held):
            continue  # (the queries' own padding, held too, says as many: a decoder's real tokens, unpadded rightly)
        if not any(cross(call) for call in calls):
            continue  # (a self-attention's queries are its keys: unpadding both by one mask is right)
        b = int(np.flatnonzero(cut < q_len)[0])
        call = [c for c in calls for _ in _segments(c)][b]  # (the call attending row b)
        lost = q_len - int(cut[b])
        results.append((call, Finding("queries-unpadded-by-keys", (
            f"the cross-attention at {call.where} was handed {q_len} queries in each of {batch} rows, yet attends "
            f"{[int(c) for c in cut]} of them per row: as many as its keys' padding `{held['name']}` ({held['where']}: "
            f"{[int(k) for k in n]} real keys) keeps, the queries unpadded with the key padding (a self-attention's "
            f"unpad), so row {b} loses {lost} quer{'y' if lost == 1 else 'ies'}"),
            expected=f"{q_len} queries per row over each row's real keys", source=f"{held['name']} ({held['where']})",
            cell=(b, int(cut[b]), 0))))
    return results


RULES = (
    Rule("queries-unpadded-by-keys", "wrong", "call", "a cross-attention whose queries were unpadded with its keys' "
         "padding mask: each row keeps as many queries as its memory has real keys, the rest dropped",
         queries_unpadded_by_keys),
)
