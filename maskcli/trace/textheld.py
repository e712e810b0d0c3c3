"""The prompt mask a text-conditioned model call was handed, and those its caller holds where it was handed none.

A text-conditioned model (a diffusion transformer's joint or cross attention over a T5 or CLIP prompt) takes the
prompt's hidden states (`encoder_hidden_states`, `context`, `txt`) of (B, T) tokens beside the prompt's padding mask
(`attention_mask`, `encoder_attention_mask`, `txt_attention_mask`). Read as each such call runs (outer.py): the mask it
was handed, where it is a 2-D 0/1 tensor of (B, T) (bool, integer or float: a processor that casts it keeps its
values); where it was handed none, the 2-D 0/1 tensors of (B, T) with some 0 and a 1 in every row that the functions
of the program that made the call hold as variables (a pipeline's `negative_mask` beside the
`negative_prompt_embeds` it hands the unconditional call). checks/leftoff.py compares the calls of one module.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from maskcli.trace.held import program_frames
from maskcli.trace.tops import MOST, _given

TEXT = re.compile(r"^(?:encoder_hidden_states|encoder_states|context|txt|text|text_states|text_embeds|prompt_embeds"
                  r"|caption_feats|cap_feats)$")  # the prompt's hidden states, (B, T, D)
MASK = re.compile(r"^(?:encoder_)?attention_mask$"
                  r"|^(?:txt|text|prompt|context|caption|encoder)_(?:attention_|attn_)?mask$")  # the prompt's mask
FRAMES = 2  # the caller and theirs: the pipeline step that made the call
HELD = 4  # held masks kept at most


def text_held(module, args: tuple, kwargs: dict, caller) -> dict:
    """{"text_mask": (parameter, int (B, T), caller)} for a call handed its prompt's mask; {"text_held": (parameter,
    (B, T), ((name, where, int (B, T)), ...), caller)} for one handed none while its caller's frames hold such masks;
    else {}. `caller`: the function of the program that made the call."""
    signature, given = _given(module, args, kwargs)
    if signature is None:
        return {}
    names = [name for name in signature.parameters if MASK.match(name)]
    text = next((value for name, value in given.items() if TEXT.match(name) and issubclass(type(value), torch.Tensor)
                 and value.dim() == 3), None)
    if not names or text is None:
        return {}
    shape = (int(text.shape[0]), int(text.shape[1]))
    frames = list(program_frames(caller, FRAMES))
    by = _where(frames[0].f_code) if frames else ""  # (the function that made the call: its calls are one step's)
    handed = [(name, given[name]) for name in names if given.get(name) is not None]
    if handed:
        rows = _rows(handed[0][1], shape, padded=False)
        return {} if rows is None else {"text_mask": (handed[0][0], rows, by)}
    found = []
    for n, frame in enumerate(frames):
        code = frame.f_code
        if code.co_name == "<module>" and not (n == 0 and frame.f_globals.get("__name__") == "__main__"):
            continue  # (a module's globals speak for no call but the main module's own line that made this one)
        for name, value in list(frame.f_locals.items()):
            rows = _rows(value, shape, padded=True)
            if rows is not None and len(found) < HELD:
                found.append((name, _where(code), rows))
    return {"text_held": (names[0], shape, tuple(found), by)} if found else {}


def _where(code) -> str:
    return f"{'the top' if code.co_name == '<module>' else code.co_name + '()'} of {os.path.basename(code.co_filename)}"


def _rows(value, shape: tuple, padded: bool) -> np.ndarray | None:
    """Int (B, T) of a 2-D tensor of that shape holding only 0 and 1 (with `padded`: some 0, a 1 in every row)."""
    if not issubclass(type(value), torch.Tensor) or tuple(value.shape) != shape or value.numel() > MOST \
            or value.device.type == "meta":
        return None
    values = value.detach()
    if not bool(((values == 0) | (values == 1)).all()):
        return None
    rows = values.cpu().to(torch.int64).numpy()
    if padded and (rows.all() or not rows.any(axis=1).all()):
        return None
    return rows
