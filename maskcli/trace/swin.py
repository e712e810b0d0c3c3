"""What a Swin block states of its shifted windows, read at an attention call made under it (checks/swin.py).

A running module holding `shift_size` > 0 and `window_size` (or Uformer's `win_size`: Swin's SwinTransformerBlock, its ports and its kin) says
its windows are cut from a map rolled by that shift, so the mask its window attention is handed is fixed by those two
numbers and the map's size. Read only under such a module: the (nW, N, N) mask (`mask` / `attn_mask`, 0 / -100 added,
or bool; (nW * B, 1, N, N) as
repeated over a batch's images) a function of the program on the stack holds, and the module's `input_resolution` where it has one.
With it (and for a block of windows of any shape, mask or none) "rolled": how far the block rolled its map
(trace/swinroll.py, checks/swinroll.py); "edited": a shift_size the block's forward edited in place
(trace/assigned.py, checks/swinedit.py); "index": a window module's relative-position index that gives two offsets
one bias row (trace/relindex.py, checks/relindex.py); "grouped": a window or grid block whose groups are not the
rows by columns of its map its size states (trace/groups.py, checks/groups.py).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from maskcli.trace.assigned import edited
from maskcli.trace.groups import window_groups
from maskcli.trace.held import program_frames
from maskcli.trace.relindex import collisions
from maskcli.trace.swinroll import block_roll, window_of

INNERMOST = 4  # running modules read, innermost first
FRAMES = 4  # program frames searched for the windows' mask
NAMES = ("mask", "attn_mask")


def _size(value) -> int | None:
    """An int, or a pair of equal ints (square windows); None otherwise."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def shifted_windows(stack: list) -> dict | None:
    """{"window", "shift", "resolution", "keep": bool (nW, N, N)} under a module with a shift; with "edited" where the
    block's shift_size was edited in place (trace/assigned.py), "index" where a window module's relative-position
    index gives two offsets one row (trace/relindex.py) and "grouped" where a block's groups are not the gh x gw cells
    of its map it states (trace/groups.py); None where none is said."""
    found = _shifted(stack)
    for module in reversed(stack[-INNERMOST:]):
        own, extra = module.__dict__, {}
        if "shift_size" in own and (changed := edited(module)) is not None:
            extra["edited"] = changed
        if "relative_position_bias_table" in (own.get("_parameters") or ()):
            if (index := collisions(module)) is not None:
                extra["index"] = index
        if (found is None or "grouped" not in found) and (grouped := window_groups(module)) is not None:
            extra["grouped"] = grouped
        if extra:
            found = {"window": None, "shift": None, **(found or {}), **extra}
    return found


def _shifted(stack: list) -> dict | None:
    for module in reversed(stack[-INNERMOST:]):
        own = module.__dict__
        if "shift_size" not in own:  # (every call of every program passes here: the common case first)
            continue
        rolled = block_roll(module)  # (how far the block rolled its map: checks/swinroll.py; any windows' shape)
        shift, window = _size(own.get("shift_size")), _size(window_of(own))
        if shift is None or window is None or not 0 < shift < window:
            if rolled is not None:
                return {"window": None, "shift": None, "rolled": rolled}
            continue
        keep = _held_mask(window * window)
        if keep is None:
            return None if rolled is None else {"window": None, "shift": None, "rolled": rolled}
        resolution = own.get("input_resolution")
        resolution = tuple(int(x) for x in resolution) if isinstance(resolution, (tuple, list)) and len(resolution) == 2 \
            and all(isinstance(x, int) for x in resolution) else None
        return {"window": window, "shift": shift, "resolution": resolution, "keep": keep, "rolled": rolled}
    return None


def _held_mask(tokens: int) -> np.ndarray | None:
    for frame in program_frames(sys._getframe(2), FRAMES):
        code = frame.f_code
        for name in NAMES:
            value = frame.f_locals.get(name) if name in code.co_varnames else None
            if issubclass(type(value), torch.Tensor) and value.dim() == 4 and value.shape[1] == 1:
                value = value[:, 0]  # (windows of every image, 1, N, N): one mask over the heads
            if issubclass(type(value), torch.Tensor) and value.dim() == 3 and value.shape[1:] == (tokens, tokens) \
                    and value.numel() <= 1 << 22 and value.device.type != "meta":
                value = value.detach()
                return (value if value.dtype == torch.bool else value == 0).cpu().numpy()
    return None
