"""A self-attention's first step handed fewer keys than queries, whose mask leaves real queries with no key at all.

At the first step of a call site (nothing cached before it) a self-attention's keys are its queries' own tokens and
what came before them: at least as many as the queries, each query seeing at least its own key. Where the module
names itself a self-attention (`self_attn`, `self_attention`, BERT's `attention.self`), the first call hands it fewer
keys than queries, and the queries left with no key at all are the same in every batch row, real by the model call's
own statement of its padding (none stated, or those rows real), the keys were cut after the mask was made for all of
the queries: a cache that evicts inside the call and returns only its kept rows, under a mask aligned to the bottom
right (VeloxQuant-MLX#370: StreamingLLM's `update_and_fetch` evicted before returning, mlx-lm's `"causal"` mask then
lower-right over 8 kept keys for a 12-token prompt: its first 4 tokens attend nothing).

Quiet on a cross-attention (read by checks/context.crossing from anything stronger than the lengths), on a module not
named a self-attention (a Perceiver's or a pooling attention's fewer keys are its latents), at later steps (a
sliding cache's prefill chunk may hold fewer keys) and where the empty rows are stated padding.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

SELF = re.compile(r"^(?:self_?attn|self_?attention|selfattention|self)$", re.IGNORECASE)  # a module path part


def _named_self(where: str) -> str | None:
    """The part of a module path that names a self-attention, else None."""
    return next((part for part in (where or "").split(".") if SELF.match(part)), None)


def evicted_keys(run: Run) -> list:
    """First-step self-attention calls with fewer keys than queries whose real queries see no key."""
    found, done = [], set()
    for call in run.cross:  # (more queries than keys: engine.py sets the call apart as a cross-attention)
        rows, _, q_len, k_len = call.shape
        if call.step != 0 or not 0 < k_len < q_len or call.stored is None:
            continue
        named = _named_self(call.where)
        reading = crossing(call)
        if named is None or reading.by not in ("shape", "none") or call.details.get("kv_source") == "other":
            continue  # (a cross-attention by anything stronger than its lengths; a module not named self-attention)
        key = (call.mask, call.shape, call.where.split(".")[-1])
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None:
            continue
        empty = ~cells.any(axis=(1, 3))  # (b, Lq): query rows no head of which sees a key
        if not empty.any() or not (empty == empty[:1]).all() or empty.all():
            continue  # (no empty row, rows that differ per batch row (padding), or nothing seen at all: rows.py's)
        said = stated(run.top(call), rows, q_len) if run.top(call) is not None else None
        if said is not None and not said[0][:, empty[0]].all():
            continue  # (the empty rows are padding the model call states)
        lost = np.flatnonzero(empty[0]).tolist()
        found.append((call, Finding("keys-evicted-before-mask", (
            f"the first step of {call.where} (a self-attention by its module path's {named!r}) hands its {q_len} "
            f"queries {k_len} keys, and queries {spans(lost)} see no key at all, though each is a real token whose own "
            f"key a self-attention's first step holds: keys were cut (a cache that evicts inside the call?) after the "
            f"mask was built for all {q_len}"),
            expected=f"each of the {q_len} queries sees at least its own key", source=f"module path {call.where}",
            cell=(0, lost[0], 0))))
    return found


RULES = (
    Rule("keys-evicted-before-mask", "wrong", "call", "a self-attention's first step handed fewer keys than queries, "
         "whose mask leaves real queries with no key: keys cut (evicted) after the mask was built", evicted_keys),
)
