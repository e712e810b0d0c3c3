"""The frames of one attention call, walked once for every reader of them.

At a call five readers looked at the stack, each walking it from the kernel outwards and asking of every frame
whose code it is (a dict lookup by the code's id, and a method call, per frame per reader): sites.running (the
module calls running), held.padding (the padding the program holds), windows.window_held (the window it states),
crossing's call-site line, and given.handed. The stack is the same for all of them, and so is each code's answer:
here it is walked once, each code classified once for all of them (_kind), and each reader is handed only the frames
it reads. What each reader then does with its frames is unchanged.
"""

from __future__ import annotations

import functools
import os

import torch

import maskcli.trace.held as held_module
import maskcli.trace.windows as windows_module

_CALL = torch.nn.Module._call_impl.__code__
_KINDS: dict[int, tuple] = {}  # id(code) -> (code, calls, held names or None, windows' own, names a window, crossing's)


class Walked:
    """What one call's readers read of the stack, innermost first (each a list of the frames one reader looks at)."""

    __slots__ = ("calls", "held", "windows", "line", "line_within")

    def __init__(self, calls: list, held: list, windows: list, line: tuple, line_within: tuple):
        self.calls = calls  # frames of module calls (nn.Module._call_impl, or a module's own __call__): sites.running
        self.held = held  # (frame, the names held.padding reads) of the program's first held.FRAMES frames
        self.windows = windows  # (frame, whether its code names a window) of windows.FRAMES program frames
        self.line = line  # (codes, lines) of the two innermost program frames (crossing._line)
        self.line_within = line_within  # the same, stopped at the innermost module call (crossing._line's `within`)


def walk(frame) -> Walked:
    """Every reader's frames from `frame` outwards, in one pass."""
    held_left, windows_left = held_module.FRAMES, windows_module.FRAMES
    calls, held, windows, codes, lines = [], [], [], [], []
    within = None  # (codes, lines) found before the innermost module call
    kinds = _KINDS
    while frame is not None:
        code = frame.f_code
        entry = kinds.get(id(code))
        if entry is None or entry[0] is not code:
            entry = kinds[id(code)] = (code, *_kind(code))
        _, call, names, own, window, program = entry
        if call:
            calls.append(frame)
            if call == 1 and within is None:
                within = (tuple(codes), tuple(lines))
        if names is not None and held_left:
            held_left -= 1
            held.append((frame, names))
        if own and windows_left:
            windows_left -= 1
            windows.append((frame, window))
        if program and len(codes) < 2:
            codes.append(code)
            lines.append(frame.f_lineno)
        frame = frame.f_back
    line = (tuple(codes), tuple(lines))
    return Walked(calls, held, windows, line, line if within is None else within)


def _kind(code) -> tuple:
    """(1 for nn.Module's _call_impl, 2 for a `__call__`, else 0; the names held.padding reads, None for code not the
    program's; the program's by windows.py; names a window; the program's by crossing.py)."""
    name = code.co_filename
    call = 1 if code is _CALL or code.co_name == "_call_impl" else 2 if code.co_name == "__call__" else 0
    return call, held_module.names(code), not name.startswith(own_dirs()), \
        not windows_module._NAMES.isdisjoint(code.co_varnames), not (name.startswith(_dirs()) or name.startswith("<"))


@functools.cache
def _dirs() -> tuple[str, ...]:
    """torch's code and maskcli's (crossing.py's _skip)."""
    return os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def own_dirs() -> tuple[str, ...]:
    """torch's, maskcli's and frozen code: no program frame (sites.py's frames_outside, windows.py's frames)."""
    return (*_dirs(), "<frozen")
