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
    the key before it; and of the other calls of those sites where none does (a run too short for its loss to say)."""
    found, sites, blind = set(), set(), []
    for call in run.calls:
        top = run.top(call)
        q_len, k_len = call.shape[2:]
        if top is None or call.stored is None or not q_len == k_len > 1:
            continue
        cells = keep(call)
        q = np.arange(1, q_len)
        if cells is None or cells[..., q, q - 1].any():
            continue
        if "previous_token" in top.arguments:
            found.add(call.index)
            sites.add(call.where)
        else:
            blind.append(call)
    return found | {call.index for call in blind if call.where in sites}
