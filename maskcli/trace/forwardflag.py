"""A running module's forward argument that says it is causal (`use_causal_mask=True`, `is_causal=True`), read from
the program's frames at an attention call.

Keras's MultiHeadAttention and its ports take causality per call, `self_attention(h, h, use_causal_mask=True)`, not as
an attribute (trace/sites.py causal_flag reads those): the innermost running module's own forward frame, found among
the program's frames trace/walk.py walked, holds the argument as the caller passed it. Only True is read: an argument
left False says the caller did not ask, not that the layer attends both ways.
"""

from __future__ import annotations

NAMES = ("use_causal_mask", "is_causal", "causal")


def forward_flag(stack: list, frames: list) -> str | None:
    """'Class.forward(use_causal_mask=True)' where the innermost running module's forward, among `frames` ((frame, names)
    innermost first, the program's own), was handed one of NAMES as True; None otherwise."""
    if not stack or not frames:
        return None
    module = stack[-1]
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None or not any(name in code.co_varnames for name in NAMES):
        return None
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    for frame, _ in frames:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            for name in NAMES:
                if name in arguments and frame.f_locals.get(name) is True:
                    return f"{type(module).__name__}.forward({name}=True)"
            return None
    return None
