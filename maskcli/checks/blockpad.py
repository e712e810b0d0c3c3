"""The padding the program holds, over attention computed in blocks: scores (N, blocks, size, size) whose blocks laid end
to end are the padding's keys (h-transformer-1d's finest level of its hierarchy, a blockwise local attention).

The call's second axis is no head axis where the attending module states its head count (details["stated_heads"],
trace/queried.py) and the axis is not it, while blocks * size is the length of a padding mask or lengths a function of
the program holds (trace/held.py, read as checks/held.py reads it: every way the batch may be folded with the heads).
Query i of block n is token n * size + i; the keys of block n are its own block's tokens, or its sibling's (n ^ 1: a
hierarchical attention's off-diagonal blocks, keys flipped two by two). Where, every way round, a real query sees a key
that padding calls padding, the padding was never handed on (h-transformer-1d 4e7f4fc: `self.layers(x)` without
`mask`). A call that keeps to one reading is quiet.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.held import readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding

LAYOUTS = ("its own block", "its sibling block")  # where block n's keys lie: block n, block n ^ 1


def block_padding(run: Run) -> list:
    """A call in blocks whose real queries see keys the held padding calls padding, every way it may be read."""
    found, done = [], set()
    for call in [*run.calls, *run.unmasked]:  # (a site in blocks that masks nowhere is the bug itself: its softmax is read
        # as attention where its module states heads and the program holds a padding over its blocks laid end to end)
        rows, blocks, size, width = (int(x) for x in call.shape)
        heads = call.details.get("stated_heads")
        if size != width or size < 2 or not not_heads(call) or call.mask in done:
            continue
        for held in call.details.get("held_padding") or ():
            tables = readings(held, rows, blocks * size)
            cells = keep(call) if tables else None
            if cells is None:
                continue
            seen = np.broadcast_to(cells, (rows, blocks, size, size))
            lost = [seen & _real(real, size, blocks, False)[..., :, None] & ~_real(real, size, blocks, flip)[..., None, :]
                    for real in tables for flip in (False, True)[:2 - blocks % 2]]  # (no sibling of an odd last)
            if not all(one.any() for one in lost):
                continue
            done.add(call.mask)
            b, n, i, j = first_cell(lost[0])
            found.append((call, Finding("padding-unused-in-blocks", (
                f"{call.where}'s {call.api} over {blocks} blocks of {size} (its module states {heads} heads): "
                f"{_row(b, rows, held)}: query {n * size + i} sees key {n * size + j}, which the program's own "
                f"{held['name']} ({held['where']}) calls padding, read with block n's keys as "
                f"{' or as '.join(LAYOUTS[:2 - blocks % 2])}, and every way the rows fold: the padding never reached the blocks"),
                expected=held["name"], source=held["name"], cell=(b, n * size + i, n * size + j))))
            break
    return found


def not_heads(call) -> bool:
    """The call's second axis is no head axis: its attending module states a head count (trace/queried.py) that the
    axis, of more than one, is not."""
    heads = call.details.get("stated_heads")
    return heads is not None and int(call.shape[1]) not in (1, heads)


def _row(b: int, rows: int, held: dict) -> str:
    """'batch row b', or 'row b of the N' where the held batch is folded with the heads into the call's rows."""
    size = held["rows"].shape[0] if held["rows"].ndim == 2 else held["rows"].size
    return f"batch row {b}" if size == rows else f"row {b} of the {rows} (the batch of {size} folded with the heads)"


def _real(real: np.ndarray, size: int, blocks: int, flip: bool) -> np.ndarray:
    """Bool (rows, blocks, size): whether each block's token i is real, block n read as block n ^ 1 where `flip`."""
    order = np.arange(blocks) ^ 1 if flip else np.arange(blocks)
    return real.reshape(real.shape[0], blocks, size)[:, order]


RULES = (
    Rule("padding-unused-in-blocks", "wrong", "call", "attention computed in blocks (N, blocks, size, size) whose real "
         "queries see keys the padding the program holds calls padding, every way the blocks' keys and the batch's fold "
         "may be read: the mask never reached the blocks (h-transformer-1d 4e7f4fc)", block_padding),
)
