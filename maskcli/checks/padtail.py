"""A decode step that continues a prompt whose last position its own mask calls padding.

A causal LM's first decode step appends the token the prefill's last query predicted: the query at position L - 1
of a prompt L long. Where the site's first decode step after a prefill (its query at position L, right after the
prompt) hides key L - 1 of a batch row while it sees earlier keys of that row and its own, the mask states that the
prompt's last position is padding, and the token being decoded was predicted from that padding query's output:
the prompt's real text ends before its padding (right padding, or padding put between the prompt and the answer),
and generation went on from a pad (DeepSpeedExamples#457: the RLHF collator padded the flipped prompts on the wrong
side, so after the flip back the pads sat after each prompt). Only the first decode step is read: a later one's
previous key is a token generation appended itself, which a finished row may mask on purpose.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _first_decodes(run: Run):
    """(prefill, its site's first decode step after it) pairs: the prefill's queries at positions 0 .. L - 1 (Lq ==
    Lk == L), the next call at the site over as many batch rows with L + Lq keys, its first query the key column L
    (its key columns positions: the cache holds the prompt, then the step's own keys)."""
    for calls in run.sites().values():
        head = None
        for call in calls:
            _, own, positions = run.placed(call)
            if not positions or not len(own):
                head = None
                continue
            q_len, k_len = call.shape[2:]
            if int(own[0]) == 0 and q_len == k_len and q_len > 1:
                head = call
                continue
            if head is not None:
                length = head.shape[3]
                if q_len < k_len == length + q_len and call.shape[0] == head.shape[0]:
                    yield head, call
                head = None  # (only the first decode step after a prefill)


def _rows(cells: np.ndarray, length: int) -> list[tuple[int, int]]:
    """(batch row, the number of padded keys ending its prompt) for each row whose first decode query sees its own key
    and a key before the prompt's last, but not the prompt's last key (the run of hidden keys just before L)."""
    found = []
    q_len = cells.shape[1]
    later = np.triu(np.ones((q_len, q_len), bool), 1)  # (query i, the step's own key j > i)
    for b, row in enumerate(cells[:, 0, :]):
        if not row[length] or row[length - 1] or not row[:length - 1].any():
            continue
        if (cells[b, :, length:length + q_len] & later).any():
            continue  # (a query of the step sees a later key of the step: its tokens were given together, as pi0's
            # state and action chunk denoised against the cached prefix, not decoded one by one from the prefill)
        last = int(np.flatnonzero(row[:length])[-1])
        if cells[b, :, last + 1:length].any():
            continue  # (padding is hidden from every query of the step: a later query that sees these keys says they
            # are the prompt's, each query reaching its own part of it, as a draft tree's training-time steps do)
        found.append((b, length - 1 - last))
    return found


def padded_tail(run: Run) -> list:
    found, done = [], set()
    for head, call in _first_decodes(run):
        if call.mask in done:
            continue
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        length = head.shape[3]
        rows = _rows(by_row(cells, call.shape[0]), length)
        if not rows:
            continue
        b, pads = rows[0]
        others = f" ({len(rows)} such batch rows)" if len(rows) > 1 else ""
        found.append((call, Finding("continued-from-padding", (
            f"batch row {b}: the first decode step's query (position {length}) sees its own key and the prompt's real "
            f"tokens but not key{'s' if pads > 1 else ''} {length - pads}{'' if pads == 1 else f'-{length - 1}'}, "
            f"which the mask calls padding at the end of the {length}-token prompt{others}: the token decoded here "
            f"was predicted from a padding query's output (position {length - 1}): the prompt's pads sit after its "
            f"text (right padding, or pads between prompt and answer) where generation needs them before it"),
            expected=f"batch row {b}: the prompt's last position ({length - 1}) a real token",
            source=f"the mask of {call.where} at its first decode step after the prefill at step {head.step}",
            cell=(b, length, length - 1))))
    return found


RULES = (
    Rule("continued-from-padding", "wrong", "site", "a decode step that continues a prompt whose last position the "
         "mask calls padding (its first token predicted from a pad: right padding under generation)", padded_tail),
)
