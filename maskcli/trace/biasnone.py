"""A module's forward whose position bias parameter holds None where the kernel is called (`position_bias=None`).

T5's and WavLM's layers take the relative position bias as a forward parameter: the first layer computes it from its
own embedding (`has_relative_attention_bias = i == 0`) and every later one is handed it by the loop over the layers.
Read from the innermost running module's own forward frame (among the program's frames trace/walk.py walked, as
askedcausal.py reads its words): where one of its parameters is named for a position bias (`position_bias`,
`pos_bias`, `rel_pos_bias`, `relative_position_bias`) and holds None at the kernel (the layer neither was handed one
nor computed one), details `bias_none` = (the class, the parameter), for checks/biasdropped.py.
"""

from __future__ import annotations

import re

from maskcli.trace.forwardflag import forward_frame

_NAME = re.compile(r"(?:rel(?:ative)?_)?pos(?:ition)?_bias")


def _takes(code) -> bool:
    return any(_NAME.fullmatch(name) for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])


def note(details: dict, stack: list, walked) -> None:
    """details["bias_none"] = (class, parameter) where the innermost running module's forward holds its position bias
    parameter as None at this call."""
    if not stack or walked is None or type(stack[-1]).__module__.startswith("torch."):
        return
    found = forward_frame(stack, walked.held, _takes)
    if found is None:
        return
    frame, arguments = found
    for name in arguments:
        if _NAME.fullmatch(name) and name in frame.f_locals and frame.f_locals[name] is None:
            details["bias_none"] = (type(stack[-1]).__name__, name)
            return
