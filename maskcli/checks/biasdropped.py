"""Layers of one stack whose first layer adds a position bias and whose later layers, handed none, add none.

T5's and WavLM's layers compute their relative position bias in the first layer only (`has_relative_attention_bias =
i == 0`) and hand it on: every later layer's forward takes it as `position_bias`. Within one pass over the layers, the
calls of one stack of sibling layers (call sites whose paths differ only by the layer number, of one shape) are read
in layer order: where the first adds a bias to its scores (an SDPA float mask with values besides 0 and its fill, or a
softmax's added bias that is not 0 on every kept cell: trace/posbias.py) and later ones add none while their forward's
position bias parameter holds None at the kernel (trace/biasnone.py), the loop over the layers dropped the bias the
first one made (pytorch/audio#3350: `get_intermediate_outputs` called `layer(x, attention_mask)  # Ignore
position_bias`, so WavLM's layers 1-3 attended with no bias at all). Wrong: the stack's first layer states the bias,
and the later layers' forward states that they take it. Quiet where a later layer computes or is handed one.
"""

from __future__ import annotations

import re

from maskcli.checks.context import Run, layer
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _biased(call) -> bool:
    profile = call.details.get("position_bias")
    return bool(call.details.get("bias")) or isinstance(profile, dict) and "zero" not in profile


def bias_dropped(run: Run) -> list:
    """The later layers of a stack handed no position bias where its first layer adds one."""
    sites: dict[tuple, list] = {}
    for call in sorted([*run.calls, *run.unmasked], key=lambda call: call.index):
        if layer(call) is not None:
            sites.setdefault((call.step, _NUMBER.sub("#", call.where), tuple(call.shape)), []).append(call)
    found = []
    for calls in sites.values():
        for first, later in _passes(calls):
            lost = [call for call in later if call.details.get("bias_none")]
            if not _biased(first) or not lost or any(_biased(call) for call in later):
                continue
            owner, name = lost[0].details["bias_none"]
            layers = sorted({layer(call) for call in lost})
            found.append((lost[0], Finding("bias-dropped", (
                f"{lost[0].where}: layer{'s' if len(layers) > 1 else ''} {spans(layers)} of this stack add no position "
                f"bias to their scores ({owner}.forward's {name} is None at the kernel), while layer "
                f"{layer(first)} ({first.where}), in the same pass, adds one: the loop over the layers did not "
                f"hand the first layer's bias on"), expected="the first layer's position bias",
                source=f"{first.where} adds a position bias", cell=(0, 0, 0))))
            break  # (one finding a stack)
    return found


def _passes(calls: list) -> list[tuple]:
    """(first call, later calls) of each pass over the stack's layers: a run of calls, in order, whose layer numbers
    rise (the model's forward calls each layer once)."""
    passes, current = [], []
    for call in calls:
        if current and layer(call) <= layer(current[-1]):
            passes.append(current)
            current = []
        current.append(call)
    passes.append(current)
    return [(one[0], one[1:]) for one in passes if len(one) > 1]


RULES = (
    Rule("bias-dropped", "wrong", "steps", "a stack's first layer adds a relative position bias and its later layers, "
         "whose forward takes it, are handed none", bias_dropped),
)
