"""The model call's own word on causality, handed as an argument: `model(input_ids, attention_mask, is_causal=False)`.

A caller that hands a decoder `is_causal=False` (an LLM2Vec-style embedding pass over a causal LM's layers) states
that this call attends both ways, whatever the attention modules' own `is_causal` attribute says: the attribute is the
default the argument overrides (transformers' `flash_attention_forward` takes `kwargs["is_causal"]` first and falls
back to `module.is_causal` only when it is absent). trace/tops.py keeps the bool when the call is handed it
explicitly (a default left in place says nothing; torch's own modules, whose is_causal is a hint that a mask given is
causal, are left out). A square self-attention of that model call that is causal on its real queries and keys
contradicts it (transformers#39707: FA2's wrapper popped the caller's is_causal and always used the module's True, so
the embedding pass stayed causal). Left alone: a call handed its own (L, L) mask (its cells are the program's word,
and is_causal=False only says add no triangle to it), cross-attention, one query, a cache's slots.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.config import _placed
from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

HANDED = ("handed_cells", "causal_named")  # (L, L) masks the model call was handed (trace/handedcells.py, causalarg.py)


def said_both_ways(top) -> bool:
    """The model call was handed `is_causal=False` outright (trace/tops.py), and no (L, L) mask of its own."""
    return top is not None and top.arguments.get("is_causal") is False and not any(n in top.arguments for n in HANDED)


def argument_ignored(run: Run) -> list:
    """A square self-attention of a model call handed is_causal=False that runs causal on its real queries and keys."""
    found, done = [], set()
    for call in run.calls:
        q_len, k_len = call.shape[2:]
        if call.stored is None or q_len != k_len or q_len < 2 or cross(call) or call.details.get("slots") is not None:
            continue
        top = run.top(call)
        word = call.details.get("call_causal")  # (a helper the program called with a literal causal=False: trace/calledflag.py)
        word = word["said"] if isinstance(word, dict) and word.get("causal") is False else None
        if word is None and not said_both_ways(top) or (call.mask, call.shape, word) in done:
            continue
        done.add((call.mask, call.shape, word))
        cells = keep(call)
        placed = None if cells is None else _placed(call, run, cells)
        if placed is None or placed.holds("full") or not placed.holds("causal"):
            continue
        hidden = ~placed.seen & placed.judged & (placed.keys[None, :] > placed.own[:, None])[None, None]
        if not hidden.any():
            continue
        b, _, q, k = first_cell(hidden)
        said = word or f"is_causal=False handed to {top.where or 'the model'}"
        stated = f"the program calls {word}" if word else \
            f"the model call was handed is_causal=False ({top.where or 'the model'}(..., is_causal=False))"
        why = "the helper dropped or defaulted the flag?" if word else "the attention read its module's own is_causal instead?"
        found.append((call, Finding("causal-argument-ignored", (
            f"{call.where}: {stated}, but its {call.api} over ({q_len}, {k_len}) scores is causal: batch row {b}'s query "
            f"{int(placed.own[q])} does not see the later real key {k} ({int(hidden.any(axis=1).sum())} such cells): "
            f"the caller's word never reached the mask ({why})"),
            expected="full", source=said, cell=(b, int(placed.own[q]), k))))
    return found


RULES = (
    Rule("causal-argument-ignored", "wrong", "steps", "a model call handed is_causal=False (an embedding pass over a "
         "decoder's layers) whose self-attention still runs causal", argument_ignored),
)
