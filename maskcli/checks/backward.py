"""Calls of a backward language model's stream: later keys that are the stream's own context, not a causal mask's slip.

A bidirectional LM (ELMo's, AllenNLP's bidirectional transformer) runs two streams over the same ids: the forward one
trained on the next token under a causal mask, the backward one on the previous token under its transpose, each
blind to its own target. Where the model call's loss trains the previous token (trace/losses.py: `previous_token`)
and no query of a call sees the key just before it, the call is that backward stream, and the later keys its queries
see are its context: trace's sees-later suspicion is answered (engine.py). sees-its-target still judges every call
against both targets (checks/tokens.py).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep


def backward_streams(run: Run) -> set[int]:
    """The indices of the square calls, under a model call whose loss trains the previous token, where no query sees
    the key before it; and of the other calls of those sites where none does (a run too short for its loss to say).
    Most runs state no previous token: nothing is read then."""
    stated = [call for call in run.calls if (top := run.top(call)) is not None and "previous_token" in top.arguments]
    found = {call.index for call in stated if _blind_to_previous(call)}
    sites = {call.where for call in run.calls if call.index in found}
    return found | {call.index for call in run.calls if call.where in sites and call.index not in found
                    and _blind_to_previous(call)}


def _blind_to_previous(call) -> bool:
    """A square call over several queries, read, none of whose queries sees the key just before it."""
    q_len, k_len = call.shape[2:]
    if call.stored is None or not q_len == k_len > 1:
        return False
    cells = keep(call)
    q = np.arange(1, q_len)
    return cells is not None and not cells[..., q, q - 1].any()
