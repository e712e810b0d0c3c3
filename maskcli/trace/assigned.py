"""What the program last assigned to a shifted-window block's `shift_size`, kept while tracing: an edit in place.

Swin's blocks and their ports state their shifted windows with `shift_size`, an int or a list per axis. A list is the
module's own object, so a function its forward hands it to can edit it in place (`shift_size[i] = 0` where the window
covers a small map: pytorch/vision#6266), and every later call of the block runs with the edited shift while the
program set another. nn.Module.__setattr__ is wrapped from the first trace on, recording only while one runs: an
assignment of `shift_size` keeps a copy of what was assigned, weakly, per module (an assignment in `__init__`, as
Swin's own `self.shift_size = 0` for a small map, is the program's statement, not an edit); `edited` says where the
module's field now differs from that copy, and what the block's forward is running on (checks/swinedit.py).
"""

from __future__ import annotations

import sys
import weakref

import torch

from maskcli.trace.held import program_frames
from maskcli.trace.swinroll import _pair  # (a tuple: a copy of a list the program may edit later)

FIELD = "shift_size"
FRAMES = 6  # program frames searched for the block's forward
_ASSIGNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its shift_size as last assigned
WRITES = [0]  # tensors (or a tuple of them) assigned to a module's attribute while tracing: state a call keeps for the
# next (a K/V cache held by the module, TabPFN's _k_cache), counted; checks/continued.py reads it between two calls.
# An attribute named as a mask is not counted: a mask the module keeps for its next call of that length


_ACTIVE = [0]  # traces running now (nested ones count): the wrapper records only while one does


def patch(trace) -> callable:
    """nn.Module.__setattr__ wrapped, to keep each block's assigned shift_size and count state writes while `trace`
    runs; what ends that. The wrapper is put on the class once, at the first trace, and stays there, passing every
    assignment straight through while no trace runs: a class attribute of nn.Module set and set back at every trace
    cost about 0.2 ms (Python re-reads every subclass's method cache: a model library's hundreds of module classes)."""
    if not _INSTALLED:
        _install()
    _ACTIVE[0] += 1

    def undo() -> None:
        _ACTIVE[0] -= 1
        if not _ACTIVE[0]:
            _ASSIGNED.clear()

    return undo


_INSTALLED: list = []


def _install() -> None:
    original = torch.nn.Module.__setattr__

    def __setattr__(self, name, value):
        if _ACTIVE[0]:
            if name == FIELD:
                try:
                    _ASSIGNED[self] = _pair(value)
                except TypeError:  # (a module that cannot be weakly referred to: not kept)
                    pass
            elif (type(value) is torch.Tensor or type(value) is tuple and value and type(value[0]) is torch.Tensor) \
                    and "mask" not in name.lower():  # (a mask kept for the next call of its length, pytorch/examples'
                WRITES[0] += 1  # `self.src_mask`, is made of the length, not of what the call computed)
        original(self, name, value)

    __setattr__.__qualname__, __setattr__.__doc__ = original.__qualname__, original.__doc__
    torch.nn.Module.__setattr__ = __setattr__
    _INSTALLED.append(original)


def edited(module) -> dict | None:
    """{"assigned", "now", "window", "map"} of a block whose shift_size differs from what was last assigned to it (an
    edit in place), `map` the (H, W) its forward is running on (its first argument, channels last (B, H, W, C), or
    (B, H * W, C) over its `input_resolution`); None where it was not edited or nothing was assigned while tracing."""
    try:
        assigned = _ASSIGNED.get(module)
    except TypeError:
        return None
    own = module.__dict__
    now, window = _pair(own.get(FIELD)), _pair(own.get("window_size"))
    if assigned is None or now is None or window is None or now == assigned:
        return None
    return {"assigned": assigned, "now": now, "window": window, "map": _map(module)}


def _map(module) -> tuple[int, int] | None:
    frame = next((f for f in program_frames(sys._getframe(1), FRAMES) if f.f_locals.get("self") is module), None)
    code = None if frame is None else frame.f_code
    if code is None or code.co_argcount < 2:
        return None
    x = frame.f_locals.get(code.co_varnames[1])
    if not issubclass(type(x), torch.Tensor):
        return None
    if x.dim() == 4:
        return int(x.shape[1]), int(x.shape[2])
    resolution = _pair(tuple(module.__dict__.get("input_resolution") or ())[-2:] or None)
    return resolution if x.dim() == 3 and resolution and resolution[0] * resolution[1] == x.shape[1] else None
