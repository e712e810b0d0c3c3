"""An attention module that holds `causal = True` under a model the program built not causal.

A model whose constructor was handed `causal=False` (or `is_causal=False`, `bidirectional=True`) by the script's own
top-level statement (trace/builtflag.py, read by trace/queried.py: details["built_not_causal"]) is an encoder: its
tokens attend both ways. An attention module under it that holds `causal = True` itself (details["module_causal"],
trace/sites.py) and whose mask lets no query see a later key, while later keys are there to see, ignored the model's word
(lucidrains/routing-transformer 57b1573: `SelfAttention` built `LocalAttention(window, causal = True)` whatever the
RoutingTransformer was asked; its fix passes `causal = causal`).

Quiet: a module that says nothing of its direction, or says not causal; a model built with no word, or causal; a
call whose queries have no later key (one query, a decode step); cross-attention; a mask that lets some query see a
later key (the module's flag then does something else).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def causal_under_encoder(run: Run) -> list:
    """Calls of a module holding causal=True, under a model built causal=False, that let no query see a later key."""
    found, done = [], set()
    for call in run.calls:
        built, flag = call.details.get("built_not_causal"), call.details.get("module_causal")
        if built is None or flag is None or cross(call) or call.shape[2] < 2 or (call.mask, tuple(call.shape)) in done:
            continue
        done.add((call.mask, tuple(call.shape)))
        cell = _missed(run, call)
        if cell is not None:
            found.append((call, Finding("causal-under-encoder", (
                f"{call.where} holds causal=True ({flag}) and no query sees a later key (batch row {cell[0]}: query "
                f"{cell[1]} misses key {cell[2]}), but the model it runs in was built not causal ({built}): its "
                f"attention should see both ways (a causal flag hard-coded in the module, not handed the model's)"),
                expected="bidirectional", source=built, cell=cell)))
    return found


def _missed(run: Run, call) -> tuple[int, int, int] | None:
    """(batch row, query, key) of the first later key a query that sees some key misses, where no query sees a later
    key and later keys are there (the queries placed among the keys as the run places them); None otherwise."""
    cells = keep(call)
    own = run.placed(call)[1]
    if cells is None or own.size != call.shape[2]:
        return None
    ahead = np.arange(call.shape[3])[None, :] > own[:, None]  # (Lq, Lk): the keys after each query's own
    if not ahead.any() or (cells & ahead).any():
        return None
    missed = np.broadcast_to(ahead, cells.shape) & cells.any(axis=-1, keepdims=True)
    if not missed.any():
        return None
    b, _, q, k = first_cell(missed)
    return b, q, k


RULES = (
    Rule("causal-under-encoder", "wrong", "call", "an attention module holding causal=True runs causal under a model "
         "the script built with causal=False (a causal flag hard-coded, not handed down)", causal_under_encoder),
)
