"""A padding mask from the batch's lengths read the wrong way round: the padding attended, the real tokens hidden.

A function of the program on the stack holds the batch's lengths (`text_len`, `lengths`, `*_lens`: trace/held.py).
Where, under one way those lengths may lie over the call's keys (real tokens first, or last), every query of each
padded batch row that sees a key sees exactly the keys the lengths call padding, and the rows the lengths call whole
see no key at all (NaN weights, or SDPA's zeros), the mask was read the wrong way round: `arange(L) < lengths`
(True = real) handed where True means "mask" (NVIDIA/NeMo#6584: the TTS aligner's `get_mask_from_lengths(text_len)`
into `masked_fill_(mask, -inf)`), or the padding (True = padding) handed to SDPA, which reads True = may attend.
The other reading then hides real keys in every row, so no reading of the program's own lengths is kept to: wrong.
Quiet where a padded row's query sees a key the reading calls real, where a whole row sees a key, and on a mask that
is the complement only as causality is (every such key after every query: held.after_every_query). A held padding
mask (True = padding, or 1 = real) turned round is held.py's padding-only-attended.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.held import after_every_query, readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _turned(seen: np.ndarray, real: np.ndarray) -> bool:
    """Cells (rows, Lq, Lk) that keep to `real` (rows, Lk) read the other way round: whole rows see nothing, and every
    query of a padded row that sees a key (each padded row has one) sees exactly its padding."""
    whole = real.all(axis=1)
    if seen[whole].any():
        return False
    sees = seen[~whole].any(axis=2)  # (a padded query row may be masked whole: the queries' own padding)
    if not sees.any(axis=1).all():
        return False
    return bool(((seen[~whole] == ~real[~whole][:, None, :]) | ~sees[:, :, None]).all())


def lengths_inverted(run: Run) -> list:
    """Calls whose mask is the complement of the real keys the batch's held lengths state, one way they may lie."""
    found, done = [], {}
    for call in [*run.calls, *run.cross]:
        helds = [held for held in (*(call.details.get("held_padding") or ()), *(call.details.get("held_top") or ()))
                 if held["kind"] == "lengths"]  # (a script's top-level lengths too: trace/toplevel.py)
        if not helds or call.stored is None:
            continue
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                continue
            seen = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))  # (over the heads)
            for held in helds:
                real = next((one for one in readings(held, rows, k_len) if _turned(seen, one)), None)
                if real is None or after_every_query(call, run, real[~real.all(axis=1)], 0):
                    continue
                b, whole = int(np.flatnonzero(~real.all(axis=1))[0]), int(np.flatnonzero(real.all(axis=1))[0])
                said = f"{held['name']} in {held['where']}"
                done[key] = Finding("lengths-inverted", (
                    f"the mask keeps exactly the keys that the batch's lengths (`{held['name']}` in {held['where']}) call padding: batch row {b} sees only "
                    f"keys {np.flatnonzero(~real[b]).tolist()}, and batch row {whole}, which the lengths call whole, "
                    f"sees no key at all: the mask read the wrong way round (a mask of the real tokens filled where it "
                    f"is True, or the padding handed where True = may attend is read)"), expected=f"the real keys of {held['name']}", source=said,
                    cell=(b, 0, int(np.flatnonzero(~real[b])[0])))
                break
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("lengths-inverted", "wrong", "call", "a mask that keeps exactly the keys the batch's lengths held by the "
         "program's own frames call padding, its whole rows seeing no key: the mask read the wrong way round",
         lengths_inverted),
)
