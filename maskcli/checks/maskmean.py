"""A mean over a batch's positions whose sum counts positions its divisor, the mask's sum, leaves out.

`x.sum(dim) / mask.sum(-1)` states which positions of each row the mean is over: the divisor counts those the 0/1
mask keeps. Where the summed tensor is not 0 at a position the mask leaves out (trace/maskmean.py: the division
recorded on the last attention call made, details `masked_mean`), the sum runs over positions the count does not hold:
the mean is inflated by the masked positions' values (rerankers#75: ColBERT's MaxSim summed over the query's [MASK]
augmentation tokens, whose attention_mask is 0, and divided by `q_mask.sum()`). Quiet where the summed tensor is 0 at
every masked position (`(x * mask).sum(dim)`: the fix), and on a mask that keeps a row whole or none of it.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def masked_mean(run: Run) -> list:
    """The masked means a trace recorded (details `masked_mean`): wrong, each."""
    found = []
    for call in [*run.calls, *run.cross, *run.unmasked]:
        for mean in call.details.get("masked_mean") or ():
            row, positions = mean["row"], mean["positions"]
            shown = ", ".join(str(p) for p in positions[:8]) + (", ..." if len(positions) > 8 else "")
            found.append((call, Finding("mean-counts-masked", (
                f"a sum over axis {mean['axis']} of a {tuple(mean['summed'])} tensor is divided by a {tuple(mean['mask'])} "
                f"mask's sum{' (' + mean['how'] + ')' if mean.get('how') else ''}, but batch row {row} sums values at "
                f"position{'s' if len(positions) > 1 else ''} {shown} "
                f"the mask leaves out of its count: the mean counts masked positions (the sum not multiplied by the "
                f"mask?)"), expected=f"0 summed at row {row}'s masked positions, as the divisor counts them",
                source="the divisor: a mask's sum", cell=(row, positions[0], positions[0]))))
    return found


RULES = (
    Rule("mean-counts-masked", "wrong", "call", "a sum over a batch's positions divided by a 0/1 mask's sum over them "
         "(a masked mean) whose summed values are not 0 at positions the mask leaves out", masked_mean),
)
