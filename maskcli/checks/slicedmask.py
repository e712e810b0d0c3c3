"""A self-attention handed a window of the program's own token-by-token mask whose rows begin at another token than its
columns.

A (B, L, L) mask over a sequence's tokens says what token i may see in row i, column j (trace/slicedheld.py reads the
one a caller holds and the window of it the attention was handed, by storage). A self-attention's queries are its
keys' tokens: its mask is that mask's window over one run of tokens, `[:, s:s + n, s:s + n]`. A window begun r rows
and c columns in, r != c, gives query i the row of token i + r over the keys of tokens c .. c + n - 1: each query sees
as another token would (EasyTPP's THP kept slicing `[:, 1:, :-1]` after the tokenizer's mask let an event see itself,
so event i sees event i + 1, the one its intensity is scored on). Said where the kernel applied the window exactly
(either polarity) and neither alignment, the rows' or the columns', gives the cells it applied.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def sliced_apart(run: Run) -> list:
    """Square self-attention calls whose mask is a held mask's window with its rows and columns begun apart."""
    found, done = [], {}
    for call in run.calls:
        helds = call.details.get("held_sliced")
        if not helds or call.shape[2] != call.shape[3] or cross(call) or call.stored is None:
            continue
        key = (call.mask, call.shape, tuple(id(held["rows"]) for held in helds))
        if key not in done:
            done[key] = _finding(call, helds)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, helds: list) -> Finding | None:
    cells = keep(call)
    rows, _, size, _ = call.shape
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    cells = np.broadcast_to(cells.any(axis=1), (rows, size, size))  # (True = kept, any head)
    for held in helds:
        table, (row, column, n) = np.asarray(held["rows"], dtype=bool), held["offsets"]
        if n != size or table.ndim != 3 or table.shape[0] != rows:
            continue
        window = table[:, row:row + n, column:column + n]
        for kept in (window, ~window):  # (its polarity unsaid: True = keep, or True = masked)
            if not np.array_equal(cells, kept):
                continue
            flip = kept is not window
            aligned = [table[:, s:s + n, s:s + n] ^ flip for s in (row, column)]
            if any(np.array_equal(cells, each) for each in aligned):
                return None  # (the window's cells are an aligned one's too: no token sees otherwise)
            b, q, k = first_cell(cells != aligned[1])
            shift, said = row - column, f"{held['name']} in {held['where']}"
            how = "sees" if cells[b, q, k] else "does not see"
            return Finding("mask-sliced-apart", (
                f"the mask is {said} ({table.shape[0]} x {table.shape[1]} x {table.shape[2]}, over the tokens) sliced "
                f"[:, {row}:{row + n}, {column}:{column + n}]: its rows begin {abs(shift)} token"
                f"{'s' if abs(shift) != 1 else ''} {'after' if shift > 0 else 'before'} its columns, so query i is given "
                f"token i {'+' if shift > 0 else '-'} {abs(shift)}'s row over its own keys (batch row {b}: query {q} "
                f"{how} key {k}); a self-attention's queries are its keys' tokens: slice rows and columns alike"),
                expected=f"[:, {column}:{column + n}, {column}:{column + n}] or [:, {row}:{row + n}, {row}:{row + n}]",
                source=said, cell=(b, q, k))
    return None


RULES = (
    Rule("mask-sliced-apart", "wrong", "call", "a self-attention handed a window of the program's own (B, L, L) mask over "
         "its tokens whose rows begin at another token than its columns (`[:, 1:, :-1]`): each query is given another "
         "token's row (EasyTPP's THP)", sliced_apart),
)
