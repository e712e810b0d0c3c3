"""A plain `mask` (1 = a real token) read as the batch's padding where the ids beside it say so (checks/real.py).

A plain `mask` / `input_mask` of a right-padded batch is padding by its shape alone; one whose 0s lead each row may be
a loss mask over a prompt as much as left padding, so its shape says nothing. The ids the model call was given say
which: left padding is one id (the pad id) at exactly the mask's 0s and nowhere at its 1s, while a prompt's loss mask
covers the prompt's varied ids. The ids may be one longer than the mask (an autoregressive wrapper trains on
`x[:, :-1]` and is handed the mask of those inputs: x-transformers' AutoregressiveWrapper), read at the mask's own
columns from either end. A mask named for the input it pads (`input_boxes_mask` beside `input_boxes`: trace/padded.py's
`input_mask`, one id per distinct box) says it is that input's padding by its name: every row may be padded there.
Segment ids as T5X and MaxText hand them (`decoder_segment_ids`, 0 for a pad) state the padding too.
"""

from __future__ import annotations

import numpy as np


def _runs(pad: np.ndarray, every_row: bool = False) -> bool:
    """Every row's padding one run at its start or every row's one run at its end, some row with none (unless
    `every_row`), some with two or more (one token at a row's edge is as often a BOS a loss mask skips)."""
    count = pad.sum(axis=1, keepdims=True)
    if not pad.any() or pad.all(axis=1).any() or (count > 0).all() and not every_row or count.max() < 2:
        return False
    columns = np.arange(pad.shape[1])[None, :]
    return bool(((columns < count) == pad).all() or ((columns >= pad.shape[1] - count) == pad).all())


def ids_padding(given: np.ndarray, ids: np.ndarray | None, every_row: bool = False) -> bool:
    """The 0/1 (B, L) `given` is the padding of `ids` (B, L) or (B, L + 1): its 0s one run at an edge of each row,
    and exactly the cells where the ids hold one value (`every_row`: a mask named for its ids, which may pad them all)."""
    if ids is None or ids.ndim != 2 or given.ndim != 2 or ids.shape[0] != given.shape[0] \
            or ids.shape[1] - given.shape[1] not in (0, 1) or given.min() < 0 or given.max() > 1:
        return False
    pad = given == 0
    if not _runs(pad, every_row):
        return False
    length = given.shape[1]
    for part in sorted({0, ids.shape[1] - length}):  # (the mask's columns from the start, then from the end)
        cells = ids[:, part:part + length]
        value = cells[pad][0]
        if ((cells == value) == pad).all():
            return True
    return False


def named_padding(arguments: dict, rows: int, length: int) -> tuple[np.ndarray, str] | None:
    """(bool (rows, length) real tokens, words): the mask a model call was handed named for its input beside it
    (trace/padded.py's `input_mask_of`) where that input's ids hold one value at exactly its 0s, one run at an edge."""
    said = arguments.get("input_mask_of")
    if not isinstance(said, tuple) or said[2].shape != (rows, length) or not ids_padding(said[2], said[3], True):
        return None
    return said[2] == 1, f"{said[0]} (its 0s exactly where `{said[1]}` holds one pad value)"


ZERO_SEGMENTS = ("decoder_segment_ids", "encoder_segment_ids")  # T5X's and MaxText's: each token's sequence, 0 = padding


def segment_padding(arguments: dict, rows: int, length: int, edge) -> list:
    """[(bool (rows, length) real tokens, words)] of the segment ids a model call was handed as T5X and MaxText name
    them, 0 for a pad (`decoder_segment_ids`), where their 0s are one run at an edge of each row (`edge`, real.py's)."""
    found = []
    for name in ZERO_SEGMENTS:
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape == (rows, length) \
                and given.dtype.kind in "iu" and given.min() >= 0 and edge(given == 0):
            found.append((given != 0, f"{name} (0 = padding)"))
    return found
