"""A softmax over one element that one module runs again and again in one model call: every weight is 1.

Softmax over an axis of one element gives exactly 1 whatever the score (the kernel's own rule): the scores the
program computed weigh nothing, and nothing it would mask is masked. A softmax of the attention's keys that runs
once per step of a loop, each over the one score of its step, is that (torch-rechub#229: DIEN's AUGRU_Cell took
`softmax(hWi.unsqueeze(1), dim=1)` over (B, 1) at each behavior, so every behavior, padded ones included, drove the
interest state with weight 1; the fix scores all steps, masks the padding and takes the softmax over time).
trace/singleton.py records such softmaxes (over scores that are not q @ kᵀ). Wrong where one module's softmax over
one element runs two or more times in one model call, each of its runs weighing its one score 1. Quiet where it runs
once per model call (one key for one query: a memory of one element), on q @ kᵀ scores over one key (a single
token's self-attention, read as any other call), on a softmax over more than one element, and where the line that
runs it also runs it over more elements (`wider`: one neighbour of a point, by the data, not by the code's shape).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def softmax_over_one(run: Run) -> list:
    """The first call of each module whose softmaxes over one element run 2 or more times in one model call."""
    runs: dict = {}
    for call in (*run.calls, *run.cross, *run.unmasked):
        top = run.top(call)
        if call.details.get("singleton") and not call.details.get("wider") and top is not None:
            runs.setdefault((id(top), call.where), []).append(call)
    found = []
    for (_, where), calls in runs.items():
        if len(calls) < 2:
            continue
        first, top = min(calls, key=lambda call: call.index), run.top(calls[0])
        b = first.shape[0]
        found.append((first, Finding("softmax-over-one", (
            f"`{where}` takes a softmax over one element {len(calls)} times in one call of {top.where} (its last "
            f"axis 1, over {b} batch rows): each weight is exactly 1 whatever its score, so the {len(calls)} "
            "steps it runs are never weighed against each other and no step can be masked (a softmax per step of "
            "the keys it should be taken over together)"),
            expected=f"a softmax over the {len(calls)} steps together, for each of the {b} batch rows",
            source="softmax over one element is 1 (the kernel's own rule)", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("softmax-over-one", "wrong", "steps", "a module that runs a softmax over one element two or more times in "
         "one model call, each weight exactly 1 (torch-rechub#229: DIEN's AUGRU_Cell softmaxed each behavior's one "
         "score, per step, so padded behaviors weighed as much as real ones)", softmax_over_one),
)
