"""A conditioning input the model's forward takes, left at None, while the function that called it holds it.

A decoder conditioned on an encoder's (or a text and melody model's) hidden states takes them as a parameter of its
forward (`encoder_hidden_states`, `encoder_outputs`, `conditioning`, `prompt_embeds`, ...) and attends them: as
cross-attention memory, or fused as a prefix of its own self-attention (MusicGen-Melody). Where a call leaves that
parameter at None while a function of the program that made it holds a tensor of that very name (a variable, or a
dict's key: generate's `model_kwargs`), the call records `input_withheld` = (name, where, shape) for
checks/condwithheld.py, which reads whether any call of the model was ever handed it. Read only where such a
parameter went unfilled, on the caller's frames outward (tops.WITHHELD_FRAMES of them), once per model call.
"""

from __future__ import annotations

import os
import re

import torch

from maskcli.trace.held import program_frames

NAMES = re.compile(r"^(?:encoder_hidden_states|encoder_outputs|conditioning|condition|cond_embeds?|prompt_embeds|"
                   r"prefix_embeds|context_embeds?)$")
FRAMES = 4  # program frames read outward from the model call (tops.WITHHELD_FRAMES)


def _parameters(module) -> tuple:
    from maskcli.trace.modules import signature_or_none

    signature = signature_or_none(type(module))
    return () if signature is None else tuple(n for n in signature.parameters if NAMES.match(n))


def _states(held):
    """The hidden states a value holds: a float (B, S, D) tensor, or an encoder output's first field."""
    if held is not None and not issubclass(type(held), torch.Tensor):
        held = getattr(held, "last_hidden_state", None) if not isinstance(held, (tuple, list)) else \
            (held[0] if held else None)
    if issubclass(type(held), torch.Tensor) and held.dim() == 3 and held.is_floating_point() and held.numel() \
            and held.device.type != "meta":
        return held
    return None


def withheld_input(module, args: tuple, kwargs: dict, caller) -> dict:
    """{"input_withheld": (name, where, shape)} of the first such parameter the call left at None that its callers
    hold, else {} (and {"input_handed": name} where the call was handed one: the model does get it)."""
    names = _parameters(module)
    if not names or caller is None:
        return {}
    from maskcli.trace.tops import _given

    _, given = _given(module, args, kwargs)
    handed = [n for n in names if _states(given.get(n)) is not None]
    if handed:
        return {"input_handed": handed[0]}
    for frame in program_frames(caller, FRAMES):
        code = frame.f_code
        if code.co_name == "<module>":
            continue  # (a module's globals speak for no call)
        variables = frame.f_locals
        for name in names:
            for held in (variables.get(name), *(v.get(name) for v in variables.values() if isinstance(v, dict))):
                states = _states(held)
                if states is not None:
                    return {"input_withheld": (name, f"{code.co_name}() of {os.path.basename(code.co_filename)}",
                                               tuple(states.shape))}
    return {}
