"""Rope positions a frame holds off the integer grid, beside the integer positions the same frame states.

A token's position is an integer: the program's `position_ids` (an integer tensor) say so, and a rotary embedding
handed a position between two of them rotates its query to no token's place. A position computed from them with a
true division where a floor division was meant (SelfExtend's grouped query position `q // g1 + g2 - g2 / g1`:
datamllab/LongLM 715c1e3) is an integer shifted by one fraction, the same for every position. Read at each attention
call from the local variables of the program's frames trace/walk.py walked (by name, matched once per code object): a
float tensor named as positions whose every value sits off the integer grid by one and the same fraction, held by a
frame that also holds an integer tensor of the same shape named as positions (what it was computed from), and that
is not that integer tensor scaled by one factor (position interpolation's `positions / factor` is a stated scaling,
its fractions differ from one position to the next). Two distinct values at least: one decode step's single position
says nothing of its neighbours. Recorded as details `offgrid_positions` for checks/offgrid.py.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from maskcli.trace.codes import ByCode

POSITIONS = re.compile(r"(?:^|_)(?:pos|position)s?(?:_ids?)?$|^pos_[qk]$")  # `group_query_position`, `pos_ids`, `q_pos`
MOST = 1 << 16  # cells of one tensor read at most
TOLERANCE = 1e-4  # (float32 positions of a few thousand carry ~1e-4 of rounding)

_NAMES = ByCode()  # code -> the local names matching POSITIONS


def note(details: dict, walked) -> None:
    """details["offgrid_positions"] where a program frame holds positions off the grid beside its integer ones."""
    if walked is None:
        return
    for frame, _ in walked.held:
        code = frame.f_code
        names = _NAMES.get(code)
        if names is None:
            names = _NAMES.put(code, tuple(name for name in code.co_varnames if POSITIONS.search(name)))
        if len(names) < 2:
            continue
        variables = frame.f_locals
        held = [(name, value) for name in names if isinstance(value := variables.get(name), torch.Tensor)
                and 0 < value.numel() <= MOST and value.device.type != "meta"]
        integers = [(name, value) for name, value in held if not value.is_floating_point() and value.dtype != torch.bool]
        for name, value in held:
            if value.is_floating_point():
                found = _off_grid(value, [(n, v) for n, v in integers if v.shape == value.shape])
                if found is not None:
                    details["offgrid_positions"] = {"name": name, "function": getattr(code, "co_qualname", code.co_name),
                                                    **found}
                    return


def _off_grid(value: torch.Tensor, integers: list) -> dict | None:
    """{integer, fraction, values, cells} where `value` is off the grid by one fraction and not an integer tensor of
    `integers` scaled by one factor; else None."""
    if not integers:
        return None
    rows = value.detach().cpu().double().numpy().reshape(-1)
    if not np.isfinite(rows).all() or len(np.unique(rows)) < 2:
        return None
    fraction = rows - np.floor(rows)
    if not (TOLERANCE < fraction[0] < 1 - TOLERANCE) or np.abs(fraction - fraction[0]).max() > TOLERANCE:
        return None
    for name, stated in integers:
        base = stated.detach().cpu().numpy().reshape(-1).astype(np.float64)
        nonzero = base != 0
        if not nonzero.any() or (rows[~nonzero] != 0).any():
            return {"integer": name, **_said(rows, fraction[0])}
        ratio = rows[nonzero] / base[nonzero]
        if np.abs(ratio - ratio[0]).max() > TOLERANCE * max(1.0, abs(ratio[0])):
            return {"integer": name, **_said(rows, fraction[0])}
    return None


def _said(rows: np.ndarray, fraction: float) -> dict:
    return {"fraction": round(float(fraction), 4), "values": [round(float(x), 4) for x in rows[:6]], "cells": int(rows.size)}
