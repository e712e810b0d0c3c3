"""A completion token the trainer scores that the model call's attention_mask hides inside its row.

RL trainers hold a completion mask beside the log-prob forward (trace/scored.py: TRL's `completion_mask`, verl's
`response_mask`, over the last tokens of each row, 1 = a token whose log-prob the loss counts). A token it counts is
a real token of the rollout; where the attention_mask the model call is given marks it 0 inside its row (real tokens
after it) and a later real query that sees a key before it does not see it, the mask was built some other way
than from the real tokens: from the ids at a pad id that is also the EOS (huggingface/trl#4970: with pad == EOS
`completion_ids != pad_token_id` masks every turn's EOS of a multi-turn completion). tokens.py's
trained-token-masked says the same from the targets of a cross-entropy loss. A 0 at a row's end (no real token after
it), a completion mask longer than the rows, or rows that differ in number are left alone.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, real_queries
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _calls
from maskcli.text import Finding


def hidden(given: np.ndarray, counted: np.ndarray) -> np.ndarray | None:
    """Bool (B, L): tokens the completion mask `counted` (B, C, over the rows' last C tokens) counts that the 0/1
    attention_mask `given` (B, L) marks 0 with a real token after them; None where they do not fit."""
    if given.ndim != 2 or counted.ndim != 2 or counted.shape[0] != given.shape[0] or counted.shape[1] > given.shape[1] \
            or not np.isin(given, (0, 1)).all():
        return None
    trained = np.zeros(given.shape, dtype=bool)
    trained[:, given.shape[1] - counted.shape[1]:] = counted == 1
    real = given == 1
    later = np.flip(np.cumsum(np.flip(real, axis=1), axis=1), axis=1) > real  # a real token after it
    return ~real & trained & later


def scored(run: Run) -> list:
    """A later real query that does not see a completion token the trainer scores, hidden by the attention_mask."""
    found = []
    for top in run.tops:
        said, given = top.arguments.get("scored"), top.arguments.get("attention_mask")
        if said is None or not isinstance(given, np.ndarray):
            continue
        name, where, counted = said
        inside = hidden(given, counted)
        if inside is None or not inside.any():
            continue
        rows, length = given.shape
        at = np.arange(length)
        for call, cells, own in _calls(run, top, rows, length):
            # (a key before the hidden one that the query sees: the hidden one is within what it attends)
            sees_before = np.maximum.accumulate(cells, axis=2)
            earlier = np.zeros_like(cells)
            earlier[:, :, 1:] = sees_before[:, :, :-1]
            bad = ~cells & earlier & real_queries(given == 1, own)[:, :, None] & inside[:, None, :] \
                & (at[None, None, :] < own[None, :, None])
            if bad.any():
                b, q, k = first_cell(bad)
                count = int(inside.sum())
                found.append((call, Finding("scored-token-masked", (
                    f"batch row {b}: query {int(own[q])} does not see key {k}, a completion token the {name} of {where} "
                    f"counts, that the attention_mask of {top.where} marks padding inside the row, real tokens after it "
                    f"({count} such token{'' if count == 1 else 's'}): a mask built from the ids at a pad id that is "
                    f"also a real token's (pad == EOS)?"), expected="every scored completion token seen as a real token",
                    source=f"{name} of {where}", cell=(b, int(own[q]), k))))
                break
    return found


RULES = (
    Rule("scored-token-masked", "wrong", "steps", "a completion token the trainer's completion mask counts that the "
         "attention_mask hides inside its row", scored),
)
