"""Left padding the input ids and the position_ids state together, where no mask and no pad id the program holds says it.

A program that left-pads its prompts by hand (foundation-model-stack's `pad_input_ids`) fills each short row's start
with one id and gives those tokens no positions of their own: the position_ids stay put over them (0, or 1 as Hugging
Face's `cumsum - 1` fills them) and count 0, 1, 2, ... from the row's first real token. Both say the same tokens are
padding: a run of one id at the start of a row, two long at least in some row, over which the positions do not count
on, after which they start at 0 and count by 1, the id found nowhere else in the batch. A packed row's documents count
on from 0 over varied ids; a repeated token whose positions count on is text. The mask the program built then may
not let a real query see those keys (checks/real.py reads them; arguments.py's padding-ignored holds the mask to them:
fms 32bfbc8, whose pad flags were the pad id's own truth value, so a non-zero pad id made every pad real).
"""

from __future__ import annotations

import numpy as np


def _lead(row: np.ndarray) -> int:
    """The length of the run of the row's first id at its start."""
    differs = np.flatnonzero(row != row[0])
    return int(differs[0]) if differs.size else len(row)


def positions_padding(tokens: np.ndarray, positions) -> tuple[np.ndarray, int] | None:
    """(bool (B, L) real tokens, the pad id) where the ids (B, L) and the position_ids (B, L) state left padding as
    the module says; None where they do not."""
    if not isinstance(positions, np.ndarray) or positions.shape != tokens.shape or tokens.ndim != 2 \
            or tokens.shape[1] < 3:
        return None
    length, pads, value = tokens.shape[1], np.zeros(tokens.shape, dtype=bool), None
    for b, row in enumerate(tokens):
        n = _lead(row)
        place = positions[b]
        if n >= length or (place[:n] != place[0]).any() or place[n] != 0 \
                or (place[n:] != np.arange(length - n)).any():
            continue
        if n >= 2 and value is None:
            value = int(row[0])
        pads[b, :n] = True
    if value is None:
        return None
    pads &= tokens == value  # (a row led by another id is unpadded, its run some text)
    if (tokens[~pads] == value).any():
        return None
    return ~pads, value
