"""A sequence of a batch row, attended as a sequence of its own, that the model places otherwise than when the program
runs it alone.

A model with a table of absolute positions (trace/tables.py: GPT-2's `wpe`, OPT's `embed_positions`) reads each
token's position there, and where the program runs the same tokens alone (one row of ids, no padding, each
attention site a square self-attention from position 0), the rows its table is read at then are the program's own
statement of where those tokens sit in their sequence. In a batch call of the same model, a stretch of a row that
holds those ids, each real, and whose queries see no key outside it at each square self-attention site from position
0 (its padding and the packed sequences beside it masked: the batch attends it as a sequence of its own) must be
read at the same rows; read elsewhere, every token of it gets another position embedding than it has alone, which
is wrong: left-padded rows whose model counts positions from the row's first slot, not from its first real token
(CarperAI/trlx#509: policy and reference forwards given the attention_mask but no position_ids derived from it), or
packed sequences whose position_ids run on over the whole row instead of restarting with each (OpenRLHF b2e226f).
A model placed by rotary or relative positions has no such table and is not read (a constant shift of every
position changes nothing there); nor is a model of two tables, nor a stretch the batch lets see keys outside it
(runalone.py's unlike-run-alone says that), nor a call of a cache (its queries not from position 0).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.checks.runalone import _at, _ids, _real, _rows, _square
from maskcli.text import Finding, spans


def _positions(top, ids: np.ndarray) -> np.ndarray | None:
    """Int64 (B, L): the rows the model call read its table of positions at (trace/tables.py), one row for the batch
    broadcast to each; None where it read none or not one per token."""
    read = top.arguments.get("table_positions")
    if not isinstance(read, np.ndarray) or read.ndim != 2 or read.shape[1] != ids.shape[1] \
            or read.shape[0] not in (1, ids.shape[0]):
        return None
    return np.broadcast_to(read, ids.shape)


def _isolated(squares: dict, rows: int, width: int, b: int, i: int, n: int):
    """The first of `squares` (site -> the batch call's square self-attention calls from position 0) where the queries
    of tokens [i, i + n) of batch row `b` each see a key and none outside the stretch, at every site; None where one
    sees outside it, or sees nothing, or a call's cells are not read."""
    outside = np.ones(width, dtype=bool)
    outside[i:i + n] = False
    first = None
    for calls in squares.values():
        for call in calls:
            cells = _rows(keep(call), rows)
            if cells is None:
                return None
            seen = cells[b, i:i + n]
            if seen[:, outside].any() or not seen[:, ~outside].any(axis=1).all():
                return None
            first = first or call
    return first


def positions_unlike_alone(run: Run) -> list:
    """Stretches of batch rows attended as sequences of their own whose table of positions is read at other rows than
    the program's run of the same tokens alone reads it."""
    tops = [(top, ids, pos) for top in run.tops if (ids := _ids(top)) is not None
            and (pos := _positions(top, ids)) is not None]
    alone = [(top, ids[0], pos[0]) for top, ids, pos in tops if ids.shape[0] == 1 and ids.shape[1] >= 3
             and _real(top, ids).all() and _square(run, top, ids.shape[1])]
    found = []
    for top, ids, pos in tops:
        real, squares = _real(top, ids), None
        for other, stretch, theirs in alone:
            n = len(stretch)
            if other is top or other.where != top.where or ids.shape == (1, n):
                continue
            for b in range(ids.shape[0]):
                i = _at(ids[b], stretch)
                if i is None or not real[b, i:i + n].all() or (pos[b, i:i + n] == theirs).all():
                    continue
                squares = _square(run, top, ids.shape[1]) if squares is None else squares
                call = _isolated(squares, ids.shape[0], ids.shape[1], b, i, n)
                if call is None:
                    continue
                shift, read = pos[b, i:i + n] - theirs, spans(pos[b, i:i + n].tolist())
                why = f"each {int(shift[0])} rows on: positions counted from where the sequence sits in the row, not " \
                      f"from its first token" if (shift == shift[0]).all() else "rows apart"
                found.append((call, Finding("positions-unlike-alone", (
                    f"batch row {b}: the program runs tokens {spans(list(range(i, i + n)))} alone ({n} tokens, another "
                    f"call of {top.where}), reading its table of positions at rows {spans(theirs.tolist())}; the batch "
                    f"attends them as a sequence of their own (no key outside them) but reads them at rows {read} "
                    f"({why}; position_ids not derived from the attention_mask, or not restarting with each packed "
                    f"sequence?)"),
                    expected=f"the rows the run alone reads ({spans(theirs.tolist())})",
                    source="the program's run of those tokens alone, through the same model's table of positions",
                    cell=(b, i, i))))
                break  # (one finding a batch call per stretch run alone)
    return found


RULES = (
    Rule("positions-unlike-alone", "wrong", "steps", "a stretch of a batch row attended as a sequence of its own (no "
         "key outside it) whose model reads its table of absolute positions at other rows than the program's run of "
         "the same tokens alone: left-padded rows counted from the row's first slot, packed sequences not restarted",
         positions_unlike_alone),
)
