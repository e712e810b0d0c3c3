"""Global tokens that some token of their row cannot see: Longformer's global attention lost on its way to the mask.

A model call states which tokens attend globally by Longformer's convention: its `attention_mask` holds 0 (padding),
1 (local) and 2 (global), or it is handed a `global_attention_mask` (1 = global), as Longformer and LED take it. A
global token is seen by every real token of its row and sees them all, whatever the window. Where a self-attention call
over exactly those tokens hides a global key from a real query of its row (a window that leaves it out), the global
marks never reached the mask (allenai/longformer#28: BART's `invert_mask`, `attention_mask.eq(0)`, turned 1 and 2
alike into False, so no token was ever global). Read only where the values cannot be document numbers (a multipack
collator writes 1, 1, 2, 2, 2 in `attention_mask`: numbers that rise along the row): some 2 comes before a 1 in its
row. Quiet where every real query sees every global key, and on a call that hides no real key from a real query (full
attention: nothing global to say).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.padvalue import padded_with_id
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def marks(arguments: dict) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(bool (B, L) real tokens, bool (B, L) global tokens, the argument that says so) the model call states."""
    given = arguments.get("global_attention_mask")
    mask = arguments.get("attention_mask")
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.size and set(np.unique(given).tolist()) <= {0, 1} \
            and given.any():
        real = np.ones(given.shape, dtype=bool)
        if isinstance(mask, np.ndarray) and mask.shape == given.shape and set(np.unique(mask).tolist()) <= {0, 1}:
            real = mask == 1
        return real, (given == 1) & real, "global_attention_mask"
    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or not mask.size or padded_with_id(arguments) is not None:
        return None  # (2s on the pad id's tokens: a mask padded with the pad id, padvalue.py)
    values = set(np.unique(mask).tolist())
    if not values <= {0, 1, 2} or not {1, 2} <= values:
        return None
    at = np.arange(mask.shape[1])[None, :]
    first_two = np.where(mask == 2, at, mask.shape[1]).min(axis=1)
    last_one = np.where(mask == 1, at, -1).max(axis=1)
    if not (first_two < last_one).any():
        return None  # (2s only after the 1s: a multipack collator's second document, not global tokens)
    return mask > 0, mask == 2, "attention_mask (0 padding, 1 local, 2 global)"


def global_unseen(run: Run) -> list:
    """Self-attention calls over the model call's tokens where a real query does not see a global key of its row."""
    found, done = [], {}
    for call in run.calls:
        top = run.top(call)
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if top is None or call.stored is None or q_len != k_len or not top.arguments:
            continue
        said = marks(top.arguments)
        if said is None or said[0].shape != (rows, k_len):
            continue
        real, wide, name = said
        key = (call.mask, call.shape, real.tobytes(), wide.tobytes())
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is not None and cells.shape[0] in (1, rows):
                seen = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
                pairs = real[:, :, None] & real[:, None, :]
                unseen = pairs & ~seen & wide[:, None, :]
                if unseen.any() and (pairs & ~seen & ~wide[:, None, :]).any():
                    b, q, k = first_cell(unseen)
                    done[key] = Finding("global-tokens-unseen", (
                        f"batch row {b}: query {q} does not see key {k}, which the model call's {name} marks global "
                        f"({int(unseen.sum())} such cells): a global token is seen by every token of its row, whatever "
                        f"the window; the global marks never reached the mask"),
                        expected="every real query sees the global keys", source=f"{name} of {top.where}",
                        cell=(b, q, k))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("global-tokens-unseen", "wrong", "call", "a real query that does not see a key the model call marks global "
         "(Longformer's attention_mask value 2, a global_attention_mask): the global marks never reached the mask",
         global_unseen),
)
