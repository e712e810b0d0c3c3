"""A trajectory batch's padded steps, stated twice by the program that makes a model call: a 0/1 step mask it holds
and the model call's float input that is exactly zero on that mask's padded steps (checks/steppad.py).

An offline-RL trainer slices fixed-length windows of episodes and pads the short ones with zeros (d3rlpy's
`batch_pad_array`, in front; min-decision-transformer's, behind), keeping per step whether it is real: `batch.masks`,
`traj_mask`, `timestep_mask`. The model call is handed the observations (B, T, C) and may never be handed that mask.
Read at an outermost model call as it runs: first its own float (B, T, C) arguments, for one whose rows are all-zero
steps in a run at an edge in some batch row (a few reductions, on 3-D float inputs only); only then the program's
frames that made the call (the caller's, up to FRAMES, the main module's own line too), for a 0/1 (B, T) tensor named
as a step mask, a variable or a dict's entry (`batch["masks"]`), whose padded steps are exactly the input's zeros,
and that the model call was not handed (as it is, or turned round: Lumina2's `cap_mask`, read by its own refiner).
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from maskcli.checks.held import edge_runs
from maskcli.trace.held import program_frames

KEEP = re.compile(r"^(?:\w+_)?masks?$")  # 1 = a real step (d3rlpy's `masks`, `traj_mask`, `timestep_mask`)
PAD = re.compile(r"(?:^|_)(?:pad|padding)_masks?$|(?:^|_)is_pad$")  # True = a padded step
FRAMES = 4  # program frames read outward from the model call: its caller and theirs
MOST = 1 << 20  # elements of one input or mask read at most


def _zero_steps(given: dict) -> list[tuple[str, np.ndarray]]:
    """(name, bool (B, T) steps exactly 0 in every channel) of each float (B, T, C) argument of the model call with a
    run of zero steps at an edge of some row, not every row's every step."""
    found = []
    for name, value in given.items():
        if not issubclass(type(value), torch.Tensor) or value.dim() != 3 or not value.is_floating_point() \
                or value.shape[0] < 2 or value.shape[1] < 2 or value.numel() > MOST or value.device.type == "meta":
            continue
        if not bool((value.detach()[:, [0, -1]] == 0).all(dim=2).any()):  # (the edge steps first: most inputs end)
            continue
        zero = (value.detach() == 0).all(dim=2).cpu().numpy()
        if not zero.all():
            found.append((name, zero))
    return found


def _as_real(name: str, held) -> np.ndarray | None:
    """Bool (B, T) real steps of a 0/1 tensor named as a step mask; None for anything else."""
    pad = PAD.search(name) is not None
    if not (pad or KEEP.search(name)) or not issubclass(type(held), torch.Tensor) or held.dim() != 2 \
            or held.numel() > MOST or held.device.type == "meta":
        return None
    rows = held.detach().cpu().numpy()
    if not np.isin(rows, (0, 1)).all():
        return None
    return rows == 0 if pad else rows != 0


def _agrees(real: np.ndarray, zero: np.ndarray) -> bool:
    """The mask's padded steps, one run at an edge of each row, are exactly zero in the input, and each padded row's
    real steps are not all zero (a mask of other steps, a burn-in or a loss mask over real data, is not padding)."""
    if real.shape != zero.shape or not edge_runs(real, right_only=False):
        return False
    padded = ~real.all(axis=1)
    return bool(zero[~real].all() and not any(zero[b][real[b]].all() for b in np.flatnonzero(padded)))


def _handed(real: np.ndarray, given: dict) -> bool:
    """The model call was handed that step mask, either way round (its misuse inside is other rules' to read: this
    one reads a mask that never reached the model)."""
    for value in given.values():
        if issubclass(type(value), torch.Tensor) and tuple(value.shape) == real.shape and value.device.type != "meta":
            rows = value.detach().cpu().numpy()
            if np.isin(rows, (0, 1)).all() and ((rows != 0) == real).all() | ((rows == 0) == real).all():
                return True
    return False


def step_padding(given: dict, frame) -> dict:
    """{"step_padding": (mask name, where, bool (B, T) real steps, input name)}: the step mask the frames from `frame`
    outward hold whose padding the model call's float input holds as zeros; {} otherwise."""
    if frame is None:
        return {}
    inputs = _zero_steps(given)
    if not inputs:
        return {}
    for n, frame in enumerate(program_frames(frame, FRAMES)):
        code = frame.f_code
        if code.co_name == "<module>" and (n or frame.f_globals.get("__name__") != "__main__"):
            continue  # (a module's globals speak for no call; the main module's own line that made it does)
        variables = frame.f_locals
        held = [(name, value) for name, value in variables.items() if isinstance(name, str)]
        held += [(f'{name}["{key}"]', entry) for name, value in variables.items() if type(value) is dict
                 and len(value) <= 64 for key, entry in value.items() if isinstance(key, str)]
        for name, value in held:
            real = _as_real(name.rsplit('["', 1)[-1].rstrip('"]'), value)
            if real is None or _handed(real, given):
                continue
            for other, zero in inputs:
                if _agrees(real, zero):
                    at = "the top" if code.co_name == "<module>" else f"{code.co_name}()"
                    return {"step_padding": (name, f"{at} of {os.path.basename(code.co_filename)}", real, other)}
    return {}
