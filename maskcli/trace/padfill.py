"""Padding flags that hold an attention fill: the mask was built in place on them.

Lingvo's and praxis's convention, which TimesFM's PyTorch port keeps: `paddings` (and `input_padding`,
`patched_padding`) are float flags, 1.0 on a padded position and 0.0 on a real one, read as such downstream
(`outputs * (1 - paddings)`). A mask made from them by a view and an in-place product (`attention_mask =
paddings[:, None, None, :]; attention_mask *= -0.7 * finfo.max`: google-research/timesfm 1b95563) writes the fill into
the flags themselves. Read at each attention call from the forward parameters of the program's frames trace/walk.py
walked (by name, matched once per code object): a float tensor under such a name whose every non-zero value is one
number at most -1e4 is recorded as details `padding_fill` (the name, the function, the value, how many cells), for
checks/padfill.py to read against the call's own fill. A tensor is read once per version.
"""

from __future__ import annotations

import re

import torch

from maskcli.trace.codes import ByCode, named_parameters

FLAGS = re.compile(r"(?:^|_)paddings?$")  # float flags, 1.0 = padded (not `padding_mask`: a mask, of either form)
MOST = 1 << 16  # cells of one tensor read at most
FILL = -1e4  # a fill, as trace/masks.py reads one in scores

_NAMES = ByCode()  # code -> the parameter names matching FLAGS
_READ: dict = {}  # id(tensor) -> (tensor version, what it read as)


def note(details: dict, walked) -> None:
    """details["padding_fill"] where a frame's padding flags hold a fill."""
    if walked is None:
        return
    for _, code, name, value in named_parameters(walked, _NAMES, FLAGS):
        read = _read(value)
        if read is not None:
            details["padding_fill"] = {"name": name, "function": getattr(code, "co_qualname", code.co_name), **read}
            return


def _read(value) -> dict | None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() > MOST \
            or value.device.type == "meta":
        return None
    held = _READ.get(id(value))
    if held is not None and held[0] is value and held[1] == value._version:
        return held[2]
    values = value.detach()
    nonzero = values[values != 0]
    found = None
    if nonzero.numel() and bool((nonzero == nonzero.reshape(-1)[0]).all()) and float(nonzero.reshape(-1)[0]) <= FILL:
        found = {"value": float(nonzero.reshape(-1)[0]), "cells": int(nonzero.numel()), "of": int(values.numel())}
    if len(_READ) > 256:
        _READ.clear()
    _READ[id(value)] = (value, value._version, found)
    return found
