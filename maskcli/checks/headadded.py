"""A head mask added to the scores: one 0/1 value per head, which the softmax cancels (trace/headadded.py).

A program that adds to its scores a float tensor of 0s and 1s holding one value along each head's queries and keys,
and differing between the heads of a batch row, states a choice of heads (pruned or kept, whichever value means which).
Added before the softmax, a constant along a row of keys cancels: every head attends exactly as it would without it,
so the heads it sets apart are never told apart (PrunaAI/pruna#537: ToMe's ViT self-attention `attn_weights +
head_mask`, HF's (1, H, 1, 1) head mask; HF multiplies the weights by it after the softmax). Wrong: the program's own
mask sets heads apart and the sum it computes cannot. Quiet where the head mask multiplies the scores or the weights,
where it is one value for every head (no choice stated), and on a 0/1 mask that varies along the keys (ones-added's).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def head_mask_added(run: Run) -> list:
    """Each softmax call (once per mask) whose scores had a per-head 0/1 constant added."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:  # (a mask that does nothing leaves its site unmasked)
        apart = call.details.get("heads_added")
        if not apart or (call.mask, repr(apart)) in done:
            continue
        done.add((call.mask, repr(apart)))
        row = "" if apart["row"] is None else f"batch row {apart['row']}: "
        found.append((call, Finding("head-mask-added", (
            f"{row}a 0/1 tensor with one value per head (1 on heads {_heads(apart['ones'])}, 0 on heads "
            f"{_heads(apart['zeros'])}, of {apart['heads']}) is added to these scores before the softmax: a constant "
            "along each row of keys cancels in the softmax, so every head attends as it would without it and the heads "
            "it sets apart are not told apart (multiply the weights by the head mask after the softmax)"),
            expected="the heads the mask sets apart attended differently", source="a per-head 0/1 tensor added to the "
            "scores")))
    return found


def _heads(heads: list) -> str:
    return ", ".join(str(h) for h in heads[:8]) + (", ..." if len(heads) > 8 else "")


RULES = (
    Rule("head-mask-added", "wrong", "call", "a 0/1 head mask (one value per head, some heads 0, some 1) added to the "
         "scores before the softmax, which cancels it: the heads it sets apart attend alike", head_mask_added),
)
