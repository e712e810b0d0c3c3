"""The tokens a trainer scores, held beside a model call whose attention_mask has a hole: its completion mask.

RL trainers keep, per completion token, whether its log-prob counts (TRL's `completion_mask`, verl's `response_mask`:
(B, C) over the last C tokens of the model call's rows, 1 = a real completion token the loss counts). Read only at
an outermost model call handed a 0/1 attention_mask with a hole (a 0 between real tokens of a row: padding sits at a
row's ends), from the program's frames that made the call (checks/scored.py).
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from maskcli.trace.codes import ByCode
from maskcli.trace.held import program_frames

SCORED = re.compile(r"^(?:completion_mask|response_mask)$")
FRAMES = 4  # program frames read outward from the model call: its caller and theirs
MOST = 1 << 16  # elements of one mask read at most


def _hole(mask) -> bool:
    """A 2-D 0/1 attention_mask with a 0 that has a 1 before and after it in its row."""
    if not issubclass(type(mask), torch.Tensor) or mask.dim() != 2 or mask.numel() > MOST or mask.shape[1] < 3 \
            or mask.device.type == "meta" or mask.is_floating_point():
        return False
    real = mask.detach().cpu().numpy() != 0  # (numpy: a few reductions at every model call, generate's steps too)
    count = real.sum(axis=1)
    if (count == real.shape[1]).all():
        return False
    first = real.argmax(axis=1)
    last = real.shape[1] - 1 - real[:, ::-1].argmax(axis=1)
    return bool(((count > 0) & (last - first + 1 > count)).any())


def scored(given: dict, frame) -> dict:
    """{"scored": (name, where, int (B, C))} of the completion mask the frames from `frame` outward hold, where the
    model call's attention_mask has a hole; {} otherwise. (The frames' variable names are looked at first, matched once
    per code: at most model calls none is a completion mask's, and the mask's hole, a copy and a few reductions, is
    not read.)"""
    if frame is None:
        return {}
    frames = [frame for frame in program_frames(frame, FRAMES) if _names(frame.f_code)]
    if not frames or not _hole(given.get("attention_mask")):
        return {}
    for frame in frames:
        code = frame.f_code
        variables = frame.f_locals
        for name in _names(code):
            held = variables.get(name)
            if issubclass(type(held), torch.Tensor) and held.dim() == 2 and held.numel() <= MOST \
                    and not held.is_floating_point() and held.device.type != "meta":
                rows = held.detach().cpu().numpy().astype(np.int64)
                if np.isin(rows, (0, 1)).all():
                    return {"scored": (name, f"{code.co_name}() of {os.path.basename(code.co_filename)}", rows)}
    return {}


_NAMES = ByCode()  # code object -> the names of its variables SCORED matches, in their order ((): none, or module code)


def _names(code) -> tuple:
    found = _NAMES.get(code)
    if found is None:
        found = _NAMES.put(code, () if code.co_name == "<module>" else tuple(n for n in code.co_varnames if SCORED.match(n)))
    return found
