"""A call site that decodes with no cache, running its whole prefix again at each step (checks/steps.py's causal-lost).

A generation loop written without a cache calls the decoder on every token so far at each step: the site's passes
grow by one query a step, and each must be masked as the model was trained, causal, or its earlier tokens see the
later ones (RUCAIBox/TextBox c9fe8cb: generate called the decoder with no self_attn_mask). These helpers find such
passes at a site and read whether a pass before them was causal on its real tokens (a right-padded training batch).
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross, keep, triu
from maskcli.checks.directions import pass_directions


def causal_on_real(run: Run, call) -> bool:
    """Every real query sees exactly the real keys up to itself (a right-padded training batch's causal pass)."""
    got = pass_directions(run, call)
    return got is not None and got[1]


def rerun_passes(calls: list) -> set:
    """Indices of a site's self-attention passes that decode with no cache by running the whole prefix again: runs
    of three passes or more, each one query longer than the pass before, all masked alike (TextBox's
    TransformerEncDec.generate, whose decoder was called causal in training); empty where there are none. A run whose
    passes of several queries are causal in some and see later keys in others is no decode loop but calls over
    lengths in turn (a loop of one line over `range(2, 40)`, causal every other length)."""
    found, run = set(), []
    for n, call in enumerate(calls + [None]):
        square = call is not None and call.shape[2] == call.shape[3] and not cross(call)
        if square and run and call.shape[2] == calls[run[-1]].shape[2] + 1:
            run.append(n)
            continue
        if len(run) >= 3 and len({_sees_later(calls[i]) for i in run if calls[i].shape[2] >= 2}) == 1:
            found.update(run)
        run = [n] if square else []
    return found


def _sees_later(call) -> bool | None:
    cells = keep(call)
    return None if cells is None else bool(triu(cells, k=1).any())
