"""A mask written into a softmax's weights after the softmax, instead of into its scores before it.

trace/after.py follows each recorded softmax's output; a fill of -inf (or at most -1e4) written into it
(`att[~mask] = -inf`, `weights.masked_fill(pad, -inf)`) is recorded on the call as `filled_after`. The program
states there which keys it means to mask; the softmax had already spread the row's weight over them, so the rest
of the row does not sum to 1, and a weighted sum over weights of -inf is -inf or NaN. That contradiction is the
program's own: wrong. A fill of 0 after the softmax (WeNet's rows with no key) is not this (after.py's zeroed_after).
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.text import Finding


def filled_after(run) -> list:
    """(call, Finding) for each call site whose softmax weights the program filled with -inf after the softmax."""
    found, done = [], set()
    for call in [*run.calls, *getattr(run, "cross", ()), *getattr(run, "unmasked", ())]:
        filled = call.details.get("filled_after")
        if not filled or call.where in done:
            continue
        done.add(call.where)
        rows = filled.get("rows") or []
        value = filled.get("value", "-inf")
        found.append((call, Finding("masked-after-softmax", (
            f"the program writes {value} into {filled.get('cells')} cells of this softmax's output (batch rows "
            f"{rows}) after the softmax: the keys it means to mask already got weight from the softmax, and weights "
            f"of {value} make the weighted sum of the values inf or NaN; fill the scores with {value} before the "
            "softmax"), expected="the mask filled into the scores before the softmax",
            source="a fill written into the softmax's weights")))
    return found


RULES = (
    Rule("masked-after-softmax", "wrong", "call", "a mask (-inf fill) written into a softmax's weights after the "
         "softmax instead of into its scores before it", filled_after),
)
