"""The sliding window the program holds where it calls the kernel: its outermost statement (checks/handed.py).

A window is stated in a kernel's convention by a variable of a program frame on the way to the kernel, or by an
attribute of the object whose method that frame runs (`self`: the attention module, the backend, SGLang's
RadixAttention): `window_left` = L, `window_size` / `sliding_window` = (L, 0) (FlashAttention, FlashInfer,
Transformer Engine: a query at p sees keys p - L .. p), and SGLang's `sliding_window_size` = L on an object (the same
L; both ways, |q - k| <= L, where that object's `attn_type` is ENCODER_ONLY). -1 and (-1, -1) state no window. A plain
int `window_size` / `sliding_window` (W keys or W - 1: conventions differ) and an (h, w) pair (Swin's spatial window)
state nothing here.

The frames are read from the kernel outward and the outermost statement is kept: a frame nearer the kernel may hold
the window converted to the kernel's own convention (cuDNN's left bound is exclusive: Transformer Engine hands it
left + 1), while the outer one is what the program asked for. A layer's own -1 outside a backend that holds the model's
window (a global layer of SGLang's Gemma 3) says that layer has none.
"""

from __future__ import annotations

import sys

FRAMES = 12  # program frames read outward from the kernel's caller
LOCALS = ("window_left", "window_size", "sliding_window", "sliding_window_size")
ATTRIBUTES = ("window_left", "window_size", "sliding_window", "sliding_window_size")
NONE = "none"


def _said(name: str, value, holder=None) -> tuple | None:
    """(left, right) a value states in its name's convention, NONE for a stated absence, None where it says nothing."""
    if name == "window_left" or name == "sliding_window_size" and holder is not None:
        if type(value) is not int:
            return None
        if value < 0:
            return NONE
        if name == "sliding_window_size" and _encoder(holder):
            return value, value
        return value, 0
    if name in ("window_size", "sliding_window") and isinstance(value, (tuple, list)) and len(value) == 2 \
            and all(type(x) is int for x in value):
        if value[0] < 0 and value[1] < 0:
            return NONE
        if value[0] > 0 and value[1] == 0:
            return value[0], 0
    return None


def _encoder(holder) -> bool:
    """The object says it attends both ways: SGLang's / vLLM's attn_type ENCODER_ONLY."""
    kind = vars(holder).get("attn_type") if hasattr(holder, "__dict__") else None
    return str(getattr(kind, "name", kind)).upper() in ("ENCODER_ONLY", "ENCODER")


def window_held(skip: tuple[str, ...], depth: int = 2) -> tuple[str, int, int, str] | None:
    """(name, left, right, where) of the outermost window statement of the program frames from `depth` frames up (those
    whose files do not start with `skip`); None where none states one or the outermost states none. Frames whose
    code names neither a window nor `self` cost no locals read."""
    frame, seen, found = sys._getframe(depth), 0, None
    names = set(LOCALS)
    while frame is not None and seen < FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(skip):
            seen += 1
            varnames = code.co_varnames
            if "self" in varnames[:1] or not names.isdisjoint(varnames):
                here = _frame(frame, code)
                if here is not None:
                    found = here
        frame = frame.f_back
    return None if found is None or found[1] is NONE else found


def _frame(frame, code) -> tuple | None:
    """This frame's statement: its `self`'s attribute first (the object's word), else its own variable."""
    variables = frame.f_locals
    holder = variables.get("self") if code.co_varnames[:1] == ("self",) else None
    attributes = getattr(holder, "__dict__", None) if holder is not None else None
    if isinstance(attributes, dict):
        for name in ATTRIBUTES:
            if name in attributes:
                said = _said(name, attributes[name], holder)
                if said is not None:
                    return _shown(name, said, f"self.{name} of {type(holder).__name__}")
    for name in LOCALS:
        if name in variables and name != "sliding_window_size":  # (a bare int of that name: whose convention?)
            said = _said(name, variables[name])
            if said is not None:
                return _shown(name, said, f"{name} in {code.co_name}()")
    return None


def _shown(name: str, said, where: str) -> tuple:
    return (name, NONE, NONE, where) if said is NONE else (name, said[0], said[1], where)
