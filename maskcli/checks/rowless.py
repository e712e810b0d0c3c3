"""A mask the same for every batch row, over a batch whose lengths the program holds and which differ.

A function of the program on the stack when attention runs holds the batch's lengths (trace/held.py: `seq_len`,
`*_lens`), and they differ between rows; the attention's mask, combined from a part per pair of positions (a causal or
permutation mask) and the padding, is the same for every batch row. Padding that differs between rows cannot have
reached a mask that does not differ: where a query of a short row, on a real position, sees a key past that row's
tokens, every way the lengths may lie along the keys (right- or left-padded), the padding part was lost (docTR#1227:
PARSeq's `(gt != PAD) | (gt != EOS)` is True everywhere, so the reverse permutations saw the short words' EOS and
padding).

The lengths may leave out one token the sequence carries (a start token in front, an end token after: docTR's
`seq_len` counts the characters, its targets hold SOS + characters): a row of n tokens then holds n + 1 real keys,
so the keys are read as `max(lengths)` or `max(lengths) + 1` long, no other. Only calls with as many queries as keys
(the queries are the same positions: a two-stream decoder's position queries over its content), several batch rows,
and a mask that relates queries and keys (a padding-only mask differs between rows or is checks/held.py's). Left
alone: a mask that differs between batch rows (the padding reached it, rightly or not: other rules read it), a
causal mask over right-padded rows (no real query sees a later padding key), lengths that are all equal.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _lengths(call) -> list[dict]:
    """The held lengths of `call`'s batch rows that differ between rows and cover its keys (or all but one)."""
    rows, k_len = call.shape[0], call.shape[3]
    found = []
    for held in call.details.get("held_padding") or ():
        given = held.get("rows")
        if held.get("kind") != "lengths" or not isinstance(given, np.ndarray) or given.ndim != 1 or len(given) != rows:
            continue
        if given.min() < 1 or given.min() == given.max() or int(given.max()) not in (k_len, k_len - 1):
            continue
        found.append(held)
    return found


def one_mask_for_all(run: Run) -> list:
    """Calls whose one mask for every batch row lets a short row's real query see a key its lengths call padding."""
    found, done = [], {}
    for call in [*run.calls, *run.cross]:
        rows, _, q_len, k_len = call.shape
        if rows < 2 or q_len != k_len or q_len < 2 or call.stored is None or not call.details.get("held_padding"):
            continue
        helds = _lengths(call)
        if not helds:
            continue
        key = (call.mask, tuple(call.shape), tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = _finding(call, helds, rows, k_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, helds: list, rows: int, k_len: int) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    planes = cells.any(axis=1)  # (b, Lq, Lk)
    if planes.shape[0] not in (1, rows) or not (planes == planes[:1]).all():
        return None  # the mask differs between rows: padding reached it
    one = planes[0]
    if one.all(axis=1).all():
        return None  # masks nothing: a padding mask never built is checks/held.py's
    for held in helds:
        lengths = held["rows"].astype(np.int64) + (k_len - int(held["rows"].max()))
        at = np.arange(k_len)[None, :]
        seen = []
        for real in (at < lengths[:, None], at >= k_len - lengths[:, None]):  # right- or left-padded
            bad = one[None] & real[:, :, None] & ~real[:, None, :]  # a real position's query sees a padding key
            if not bad.any():
                break
            seen.append(bad)
        else:
            bad = seen[0]
            b, q, k = first_cell(bad)
            return Finding("padding-not-per-row", (
                f"batch row {b}: query {q} sees key {k}, past the row's {int(lengths[b])} tokens that "
                f"{held['name']} in {held['where']} states ({held['rows'].tolist()}, of these {k_len} keys), "
                f"read right- or left-padded: the mask is the same for every batch row, so the rows' padding "
                f"never reached it ({int(bad.sum())} such cells; a padding mask that masks nothing?)"),
                expected="no real query sees a key the batch's lengths call padding",
                source=f"{held['name']} in {held['where']}", cell=(b, q, k))
    return None


RULES = (
    Rule("padding-not-per-row", "wrong", "call", "one mask for every batch row (a causal or permutation part, no "
         "padding) over rows the program's held lengths say differ: a short row's real query sees keys past its "
         "tokens", one_mask_for_all),
)
