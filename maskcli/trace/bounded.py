"""The window a cache object states where the kernel runs inside one of its methods (checks/cachewindow.py).

A cache bounded to the last W tokens (VeloxQuant's `SlidingWindowKVCache(inner, window_size=4)`, a rotating cache's
`max_size`-less kin) is often no module: an object whose method hands its keys to the kernel (`cache.attend(q)`).
Where a program frame on the way to the kernel, inside the attending module, is a method of an object that is no torch module and holds an int
`window_size` / `sliding_window` W > 0 among its attributes, the keys the kernel reads are that object's, and the
object states that it keeps W of them (W + 1 by another convention; plus its sink tokens where it holds an int count
of them: StreamingLLM's `n_sinks`, `num_sink_tokens`). Recorded as (name, W, sinks, where) under "window_bounded".

An object that also states a capacity past its window (H2O's and SnapKV's `max_capacity_prompt`) or the share of the
keys it keeps (kvpress's `compression_ratio`) keeps that many keys: its window is an observation window (the last
queries, that score which keys to keep), not the cache's bound (checks/fieldnames.py's observation_window).

A module's own int `window_size` says nothing here: it is a Swin window, a local-attention block (lucidrains'
LocalAttention sees two of them), a kernel's convention (trace/windows.py reads those).
"""

from __future__ import annotations

import torch

from maskcli.checks.fieldnames import observation_window
from maskcli.trace.codes import ByCode

NAMES = ("window_size", "sliding_window")
_METHODS = ByCode()  # code object -> whether its first argument is `self`


def _method(code) -> bool:
    found = _METHODS.get(code)
    if found is None:
        found = _METHODS.put(code, (code.co_argcount > 0 and code.co_varnames[0] == "self",))
    return found[0]


def _sinks(attributes: dict) -> int | None:
    """The int count of sink tokens the object holds (0 where it names none); None where one is not an int."""
    total = 0
    for name, value in attributes.items():
        if "sink" in name.lower():
            if type(value) is not int or value < 0:
                return None
            total += value
    return total


def bounded(frames: list | None, found: dict) -> None:
    """Under found["window_bounded"]: (name, W, sinks, where) of the innermost program frame that is a method of a
    non-module object holding an int window W > 0, inside the innermost running module (`frames` innermost first: an
    engine's or a generator's method around the model holds a window for some of its layers, not these keys); nothing
    where none is."""
    for frame, _ in frames or ():
        code = frame.f_code
        if not _method(code):
            continue
        holder = frame.f_locals.get("self")
        if isinstance(holder, torch.nn.Module):
            return  # (the attending module: an object outside it, an engine or a generator, holds no keys of this call)
        if holder is None or not hasattr(holder, "__dict__"):
            continue
        attributes = vars(holder)
        for name in NAMES:
            window = attributes.get(name)
            if type(window) is int and window > 0:
                sinks = _sinks(attributes)
                if sinks is None or observation_window(attributes, window):
                    return
                found["window_bounded"] = (name, window, sinks, f"self.{name} = {window} of {type(holder).__name__} "
                                           f"in {code.co_name}()")
                return
