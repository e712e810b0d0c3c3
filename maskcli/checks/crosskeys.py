"""Cross-attention whose memory keys shrink at a later step while the other layers still cross-attend all of them.

A decoder's cross-attention attends over its encoder's output, the same memory at every step of one generation; a
window belongs to self-attention. Where one cross-attention site (context.crossing: the module's word, a memory
argument, ...) saw N keys at its first step and sees fewer at a later one, while another cross-attention site of the
same decoder sees those same N keys at that step (its first step saw N too), the memory was truncated for that layer:
a cross-attention cache built as a self-attention's, whose sliding layers keep their last W - 1 states
(huggingface/transformers#46111, T5Gemma's `DynamicCache(config=decoder_config)` for cross-attention). Quiet where no
other site at that step holds the full memory (a new generation over a shorter source changes every layer's memory),
and where the site that does was made by another model call (BridgeTower's matching model and its masked-LM model run
pairs of other lengths at the same step: each model's layers hold their own memory).
"""

from __future__ import annotations

from maskcli.checks.context import STRONG, Run, crossing
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def memory_truncated(run: Run) -> list:
    """Cross-attention calls with fewer keys than their site's first step, where a sibling site keeps the full memory."""
    first: dict[str, int] = {}
    steps: dict[tuple, list] = {}
    sites: dict[int, set] = {}  # (each model call's cross-attention sites: _model_call)
    # (engine.py sets the cross-attention calls apart; a softmax site that masks nowhere is among the unmasked, and is
    # attention where the module's word or a memory argument says it is a cross-attention)
    for call in sorted(run.cross + [one for one in run.unmasked if crossing(one).by in STRONG],
                       key=lambda one: one.index):
        if not crossing(call).cross:
            continue
        where = call.where or ""
        first.setdefault(where, call.shape[3])
        steps.setdefault((call.step, call.shape[0]), []).append(call)
        sites.setdefault(id(run.top(call)), set()).add(where)
    found = []
    for calls in steps.values():
        for call in calls:
            where, k_len = call.where or "", call.shape[3]
            full = first[where]
            if k_len >= full:
                continue
            model = _model_call(run, call, sites)
            sibling = next((other for other in calls if (other.where or "") != where and other.shape[3] == full
                            and first[other.where or ""] == full
                            and (model is None or _model_call(run, other, sites) is model)), None)
            if sibling is None:
                continue
            source = crossing(call).source
            found.append((call, Finding("cross-memory-truncated", (
                f"{where} cross-attends {k_len} memory keys at step {call.step}, but saw {full} at its first step, and {sibling.where} cross-attends all {full} at this "
                f"step ({source}): the encoder's memory was cut for this layer (a cross-attention cache kept as a "
                f"sliding self-attention's?)"), expected=f"{full} memory keys", source=source)))
    return found


def _model_call(run: Run, call, sites: dict):
    """The outermost module call that made `call` where its cross-attention calls came from more than one site (a
    model's forward over its layers), else None (the program called the layer itself: its steps are the program's
    loop). `sites`: id of each Top -> the module paths of the cross-attention calls it made."""
    top = run.top(call)
    return top if top is not None and len(sites.get(id(top), ())) > 1 else None


RULES = (
    Rule("cross-memory-truncated", "wrong", "steps", "a cross-attention layer sees fewer encoder keys at a later step "
         "than at its first, while another cross-attention layer still sees them all: the memory cut for that layer",
         memory_truncated),
)
