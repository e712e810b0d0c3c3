"""The samples a padding mask stands beside: a float input the same frame holds, read where it is exactly 0.

A padded batch is stated twice where the program pads its values with zeros and builds a 0/1 mask over them
(`np.pad(series, (0, n))` and `input_mask[...] = 0`): the mask says which samples are padding, the zeros say which
samples the padding put there. At an attention call whose frames hold such a mask (trace/held.py: a 2-D keep or
padding mask, details["held_padding"] / ["held_top"]), the frame that holds it is read for a float tensor over the
same samples, (B, S), (B, C, S) or (B, S, C), B and S the mask's, in any of the program's frames (the mask is one
tensor handed down: its values may be kept by a caller, the script's top level): the script's top-level names its
running statement reads (trace/toplevel.py), or a function's variables. Recorded as details["zero_samples"] (the mask's
name and where, the input's name and where, the mask's real samples and the input's exact zeros, (B, S) each), for
checks/padend.py to read the mask against: only inputs with exact zeros where some row of the mask hides samples the
input does not hold as 0. Each tensor is read once per version.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from maskcli.trace.toplevel import read_by

MOST = 1 << 18  # elements of one input read at most

_READ: dict = {}  # id(tensor) -> (tensor, version, S, bool (B, S) exact zeros or None)


def note(details: dict, walked) -> None:
    """details["zero_samples"] where a frame holds a padding mask and float samples of its shape beside it."""
    masks = [read for read in (*details.get("held_padding", ()), *details.get("held_top", ()))
             if read["kind"] in ("keep", "pad") and read["rows"].ndim == 2]
    if walked is None or not masks:
        return
    reals = []
    for read in masks:
        real = read["rows"] if read["kind"] == "keep" else ~read["rows"]
        if not real.all() and real.any(axis=1).all():
            reals.append((read, real))
    found, named = [], {read["name"] for read in masks}
    for frame, _ in walked.held:  # (innermost first: the mask's own frame, then its callers, the script last)
        code = frame.f_code
        names = read_by(code, frame.f_lineno) if code.co_name == "<module>" else code.co_varnames
        variables = frame.f_locals
        for name in names:
            value = variables.get(name) if name not in named else None
            for read, real in reals if issubclass(type(value), torch.Tensor) else ():
                zero = _zeros(value, real.shape)
                if zero is not None and zero.any() and (~real & ~zero).any():  # (zeros, and a mask that hides samples
                    # the input holds: read)
                    found.append({"mask": read["name"], "input": name, "where": read["where"], "real": real,
                                  "zero": zero, "held": f"{code.co_name}() of {os.path.basename(code.co_filename)}"})
        if len(found) >= 4:
            break
    if found:
        details["zero_samples"] = found


def _zeros(value, shape: tuple) -> np.ndarray | None:
    """Bool (B, S) where float `value`, (B, S), (B, C, S) or (B, S, C), is exactly 0 on every channel; None for any
    other value, and for a float mask or bias (0 and one other value: its zeros are no padding's values)."""
    if not issubclass(type(value), torch.Tensor) or value.dim() not in (2, 3) or not value.is_floating_point() \
            or value.numel() > MOST or value.device.type == "meta" or value.shape[0] != shape[0]:
        return None
    samples = shape[1]
    if value.dim() == 2:
        axis = None if value.shape[1] == samples else False
    else:
        axis = 1 if value.shape[2] == samples else 2 if value.shape[1] == samples else False
    if axis is False:
        return None
    version = None if value.is_inference() else value._version  # (inference_mode: no version counter, read afresh)
    held = _READ.get(id(value))
    if version is not None and held is not None and held[0] is value and held[1] == version and held[2] == samples:
        return held[3]
    with torch.no_grad():
        cells = value.detach()
        zero = cells == 0
        others = cells[~zero & ~torch.isnan(cells)]
        # (a float mask or bias over the samples, 0 and one other value, e.g. 0 / -inf / finfo.min / 1: a mask's zeros
        # are kept samples, not a padding value; only values that vary are samples. NaN left out: a 0/1 label padded
        # with NaN, multicenter-sepsis' hourly `labels`, is no input)
        mask_like = others.numel() == 0 or bool((others == others.reshape(-1)[0]).all())
        zero = None if mask_like else (zero if axis is None else zero.all(axis)).cpu().numpy()
    if len(_READ) > 256:
        _READ.clear()
    _READ[id(value)] = (value, version, samples, zero)
    return zero
