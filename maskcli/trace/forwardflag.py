"""A running module's forward argument that says it is causal (`use_causal_mask=True`, `is_causal=True`), read from
the program's frames at an attention call.

Keras's MultiHeadAttention and its ports take causality per call, `self_attention(h, h, use_causal_mask=True)`, not as
an attribute (trace/sites.py causal_flag reads those): the innermost running module's own forward frame, found among
the program's frames trace/walk.py walked, holds the argument as the caller passed it. True is read; False only around
a decoder that builds causal masks, and only against a forward's default that is not False (said_both_ways: an argument
left at a default of False says the caller did not ask, not that the layer attends both ways).

An attention implementation that is no nn.Module (vLLM's `FlashAttentionImpl`, held by the layer as `self.attn` and
called as `self.attn.forward_fa_npu(q, k, v)`) keeps its word as its own attribute: `self.causal = True` on an object
of the program's own class whose method runs between the innermost module's forward and the kernel says that this
call is causal, as the module's attribute would (held_flag; vllm-omni#7324: the dense NPU path never built the mask
that flag asked for). So does a per-call metadata object of the program's own class such a method is handed
(FastVideo's `SDPAMetadata(is_causal=True)`, cceacec99, blind-kk). Again only True is read.
"""

from __future__ import annotations

import torch

NAMES = ("use_causal_mask", "is_causal", "causal")
HANDED = "(handed as "  # (a per-call object's word, not the implementation's own: checks/config.both_ways reads it)


def forward_flag(stack: list, frames: list, value: bool = True) -> str | None:
    """'Class.forward(use_causal_mask=True)' where the innermost running module's forward, among `frames` ((frame, names)
    innermost first, the program's own), was handed one of NAMES as `value` (False: only against a default that is not
    False); None otherwise."""
    found = forward_frame(stack, frames, lambda code: any(name in code.co_varnames for name in NAMES))
    if found is None:
        return None
    frame, arguments = found
    for name in NAMES:
        if name in arguments and frame.f_locals.get(name) is value and (value or _default(stack[-1], name) is not False):
            return f"{type(stack[-1]).__name__}.forward({name}={value})"
    return None


def _default(module, name: str):
    """The default of `name` in the module's forward (None where it has none): False handed where False is the default
    is no word of the caller's."""
    function = type(module).forward
    code, defaults = function.__code__, function.__defaults__ or ()
    positional = code.co_varnames[:code.co_argcount]
    if name in positional[len(positional) - len(defaults):]:
        return defaults[positional.index(name) - (len(positional) - len(defaults))]
    return (function.__kwdefaults__ or {}).get(name)


def around(stack: list, frames: list, value: bool = True) -> str | None:
    """forward_flag of the innermost running module on `stack` whose forward was handed one of NAMES as `value`."""
    return next((found for i in range(len(stack) - 1, -1, -1)
                 if (found := forward_flag(stack[:i + 1], frames, value)) is not None), None)


def said_both_ways(stack: list, frames: list, details: dict) -> str | None:
    """'Class.forward(is_causal=False)' where the call runs inside a module whose forward was handed causal False
    against its default: the caller chose this pass bidirectional (GritLM's one model embeds with `is_causal=False` and
    generates causal: checks/directions.py; VALL-E's NAR passes, `is_causal=False` per split of the batch, beside a
    config that says is_decoder: checks/decoders.py)."""
    return around(stack, frames, False)


def forward_frame(stack: list, frames: list, takes) -> tuple | None:
    """(frame, its parameter names) of the innermost running module's own forward among `frames` ((frame, names),
    innermost first), where `takes(code)` says its forward may hold what the reader reads; None otherwise."""
    if not stack or not frames:
        return None
    module = stack[-1]
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None or not takes(code):
        return None
    for frame, _ in frames:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            return frame, code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return None


def held_flag(stack: list, frames: list) -> str | None:
    """'Class.causal' where a method running inside the innermost module's forward (among `frames`, innermost first)
    belongs to, or was handed, an object of the program's own class, no nn.Module, whose own attribute `causal` /
    `is_causal` is True (an attention implementation's, a per-call metadata object's)."""
    from maskcli.trace.reqlens import _read as own_object

    if not stack or not frames:
        return None
    module = stack[-1]
    for frame, _ in frames:
        variables = frame.f_locals
        owner = variables.get("self")
        if owner is module or isinstance(owner, torch.nn.Module):
            return None  # (the module's forward reached: its own word is causal_flag's)
        code = frame.f_code
        # (the object itself, then a metadata object the method was handed: FastVideo's SDPAMetadata(is_causal=True))
        for name in ("self", *code.co_varnames[int(owner is not None):code.co_argcount]):
            held = variables.get(name)
            if held is None or not own_object(held):
                continue
            fields = vars(held)
            for flag in NAMES[1:]:
                if fields.get(flag) is True:
                    return f"{type(held).__name__}.{flag}" + ("" if name == "self" else f" {HANDED}{name})")
    return None


def stated_flag(stack: list, frames: list) -> str | None:
    """The forward argument's word (forward_flag), else an attention implementation object's (held_flag)."""
    return forward_flag(stack, frames) or held_flag(stack, frames)
