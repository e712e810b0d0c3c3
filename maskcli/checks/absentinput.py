"""A batch row the program says lacks an input that still sees every key the rows holding it all see.

Octo-style policies tokenize each input (a language instruction, a goal image, a camera) into its own group of
tokens and state per sample which inputs are there: `pad_mask_dict` (input name -> (B,) bools, False where that row
lacks the input) in the batch dict the model is handed (`tasks`, `observations`, `batch`: trace/held.py, kind
"present"). A missing input's tokens are padding for that row: the mask must hide them, so the row hides some key
that every row holding the input sees (its first token at least, however the present rows are padded). Where an
absent row sees (by some query, some head) every key all present rows see, the statement never reached the mask: the
row's queries see tokens of an input it does not have (octo-pytorch b2fd085: LanguageTokenizer returned an all-ones pad
mask, so samples with no language instruction still attended task_language tokens). Wrong there, whatever other
padding (a history's timesteps) the rows differ by. Quiet where each absent row hides one such key at least (the group
hidden), where every row is present or every row absent, on cross-attention, and where the kernel was handed no mask.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def hides_none(cells: np.ndarray, present: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(an absent row, the keys every present row sees) where that row still sees each of those keys, in bool
    (B, ..., Lq, Lk) `cells` (a key seen: by some query of some head); else None."""
    seen = cells.reshape(cells.shape[0], -1, cells.shape[-1]).any(axis=1)  # (B, Lk)
    common = seen[present].all(axis=0)
    if not common.any():
        return None
    for a in np.flatnonzero(~present):
        if seen[a][common].all():
            return int(a), np.flatnonzero(common)
    return None


def absent_input_attended(run: Run) -> list:
    """Calls where a row the batch's `pad_mask_dict` says lacks an input sees every key the rows holding it see."""
    found, done = [], {}
    for call in run.calls:
        presents = call.details.get("held_present")
        if not presents or call.stored is None or cross(call):
            continue
        rows = call.shape[0]
        key = (call.mask, call.shape, tuple(p["rows"].tobytes() for p in presents))
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        presents = [p for p in presents if p["rows"].shape == (rows,)]
        cells = keep(call) if presents else None
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
        for held in presents:
            pair = hides_none(cells, held["rows"])
            if pair is None:
                continue
            a, common = pair
            what = held["name"].rsplit('["', 1)[-1].rstrip('"]')
            source = f"{held['name']} in {held['where']}"
            rows_held = np.flatnonzero(held["rows"])
            present = f"row{'s' if rows_held.size > 1 else ''} {', '.join(str(r) for r in rows_held)}"
            done[key] = Finding("absent-input-attended", (
                f"batch row {a} sees every key the rows holding {what} ({present}) see ({common.size} keys, "
                f"{spans(common)}), though {source} says row {a} lacks {what}: its queries see the tokens of an "
                f"input it does not have — the pad mask of {what}'s tokens not built from pad_mask_dict?"),
                expected=f"row {a} hides the tokens of {what}", source=source)
            found.append((call, done[key]))
            break
    return found


RULES = (
    Rule("absent-input-attended", "wrong", "call", "a batch row the batch's `pad_mask_dict` says lacks an input (Octo's "
         "per-sample input flags) that still sees every key all rows holding it see: the input's tokens attended",
         absent_input_attended),
)
