"""The padding of ids a model call holds in a batch dict (trace/heldids.py: `x["hist_movie_id"]`, padded with the pad
id the model's embeddings state), placed on an attention's keys: the ids' L tokens are L of its keys, and a few keys
more (a target item appended after a behaviour history, a CLS token prepended) are the model's own tokens, at the
start or at the end. Each placement is one reading; padding-ignored (arguments.py) speaks only where every reading
has a real query seeing a key the ids mark as padding."""

from __future__ import annotations

import numpy as np

from maskcli.checks.real import _edge

MORE = 2  # keys beyond the ids' tokens read at most (a target item, a CLS token, a summary token)


def held_readings(top, rows: int, length: int) -> tuple[list, str, bool, str] | None:
    """([bool (rows, length) real keys, one per placement of the ids among the keys], source, sure, words): the padding of
    the ids the model call holds in a batch dict, over `length` keys of `rows` batch rows; None where they hold none,
    are not a padded batch (a run of the pad id at one end of each row, some row unpadded), or place no `length` keys."""
    held = None if top is None else top.arguments.get("held_ids")
    if not isinstance(held, tuple):
        return None
    where, ids, pad_id = held
    if ids.ndim != 2 or ids.shape[0] != rows or not ids.shape[1] <= length <= ids.shape[1] + MORE:
        return None
    pad = ids == pad_id
    if not _edge(pad):
        return None
    size, readings = ids.shape[1], []
    for start in range(length - size + 1):
        real = np.ones((rows, length), dtype=bool)
        real[:, start:start + size] = ~pad
        readings.append(real)
    more = length - size
    words = "" if not more else (f" (the ids' {size} tokens read as keys {0}-{size - 1} or as keys {more}-{length - 1} "
                                 f"of the {length}, the model's {more} other key{'s' if more > 1 else ''} real: either way)")
    return readings, f"input ids {where} equal to the pad id {pad_id} (the padding_idx of the model's embeddings)", True, words
