"""The sliding window the program holds where it calls the kernel: its outermost statement (checks/handed.py).

A window is stated in a kernel's convention by an attribute of a running module (the attention module, a backend
module, SGLang's RadixAttention) or by a variable of a program frame on the way to the kernel: `window_left` = L, `window_size` / `sliding_window` = (L, 0) (FlashAttention, FlashInfer,
Transformer Engine: a query at p sees keys p - L .. p; a frame's `window_left` beside a `window_right` = R: p - L .. p + R), and SGLang's `sliding_window_size` = L on an object (the same
L; both ways, |q - k| <= L, where that object's `attn_type` is ENCODER_ONLY). -1 and (-1, -1) state no window. A plain
int `window_size` / `sliding_window` (W keys or W - 1: conventions differ) and an (h, w) pair (Swin's spatial window)
state nothing here. jax's `local_window_size` (jax.nn.dot_product_attention, and ports of it) is (left, right), p - left
.. p + right, an int w both ways (w, w).

The outermost statement is kept: the running modules' attributes, outermost first (the layer's own word), else the
frames' variables, outermost first. A frame nearer the kernel may hold the window converted to the kernel's own
convention (cuDNN's left bound is exclusive: Transformer Engine hands it left + 1), while the outer one is what the
program asked for. A layer's own -1 (a global layer of SGLang's Gemma 3, whose backend object holds the model's window)
says that layer has none.
"""

from __future__ import annotations

import sys

from maskcli.trace.bounded import bounded
from maskcli.trace.codes import ByCode

FRAMES = 12  # program frames read outward from the kernel's caller
LOCALS = ("window_left", "window_size", "sliding_window", "sliding_window_size", "local_window_size")
ATTRIBUTES = ("window_left", "window_size", "sliding_window", "sliding_window_size")
NONE = "none"
_NAMES = frozenset(LOCALS)
_CODES = ByCode()  # code object -> (the program's own, names a window)
# the innermost program frame of the last call that held a window, and its count: held, so that a later frame cannot
# take its id (one frame's locals kept alive until the next such call)
_INVOKED: list = [None, 0]


def _said(name: str, value, holder=None) -> tuple | None:
    """(left, right) a value states in its name's convention, NONE for a stated absence, None where it says nothing."""
    if name == "local_window_size":  # (jax.nn.dot_product_attention's: (left, right), p - left .. p + right; an int
        pair = (value, value) if type(value) is int else tuple(value) if isinstance(value, (tuple, list)) else ()
        return pair if len(pair) == 2 and all(type(x) is int and x >= 0 for x in pair) else None  # both ways)
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


def _right(variables: dict) -> int | None:
    """The keys after the query a frame (or a module) states beside its `window_left`: a whole `window_right` >= 0 (candle's and
    FlashAttention's `window_size_right`: a window both ways, p - left .. p + right), else None."""
    for name in ("window_right", "window_size_right"):
        value = variables.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


def _encoder(holder) -> bool:
    """The object says it attends both ways: SGLang's / vLLM's attn_type ENCODER_ONLY."""
    kind = vars(holder).get("attn_type") if hasattr(holder, "__dict__") else None
    return str(getattr(kind, "name", kind)).upper() in ("ENCODER_ONLY", "ENCODER")


def window_held(stack: list, skip: tuple[str, ...], counted: dict | None = None,
                frames: list | None = None) -> tuple[str, int, int, str] | None:
    """(name, left, right, where) of the outermost window statement: the running modules' (`stack`, outermost first)
    attributes, else the variables of the program frames (those whose files do not start with `skip`), outermost
    first; None where none states one or the outermost states none. Only frames whose code names a window have their
    locals read (a module's dict lookups cost next to nothing). `frames`: (frame, whether its code names a window) of
    the first FRAMES program frames, where the call's stack was walked already (trace/walk.py).

    `counted` (a dict), where given, gets under "window_counted" (name, W, p, where) of the outermost frame that holds
    a plain int window W > 0 (or -1, none) beside the int position p of its one query (`cur_pos`, `start_pos`: POSITIONS; or its
    sequence's length, p + 1: LENGTHS): W keys or W + 1 by its convention, at least min(W, p + 1) whichever
    (checks/handed.py's window-narrower, which reads it for one query only: a length of 1 says nothing)."""
    if counted is not None and frames is not None:
        bounded(frames, counted)  # (a cache object's window, whatever the modules state: checks/cachewindow.py)
    for module in stack:
        attributes = vars(module)
        for name in ATTRIBUTES:
            if name in attributes:
                said = _said(name, attributes[name], module)
                if name == "window_left" and said not in (None, NONE) and _right(attributes) is not None:
                    said = (said[0], _right(attributes))  # (its window_right beside it: a window both ways)
                if said is not None:
                    _invoked(frames, counted, module)
                    return _result(name, said, f"self.{name} of {type(module).__name__}")
    if frames is None:
        frames = []
        frame = sys._getframe(1)
        while frame is not None and len(frames) < FRAMES:
            own, named = _kind(frame.f_code, skip)
            if own:
                frames.append((frame, named))
            frame = frame.f_back
        if counted is not None:
            bounded(frames, counted)
    found = None
    for frame, named in frames:
        if named:
            code = frame.f_code
            variables = frame.f_locals
            for name in LOCALS:
                if name in variables and name != "sliding_window_size":  # (a bare int of that name: whose convention?)
                    said = _said(name, variables[name])
                    if name == "window_left" and said not in (None, NONE) and _right(variables) is not None:
                        said = (said[0], _right(variables))  # (its frame's window_right: a window both ways)
                    if said is not None:
                        found = (name, said, f"{name} in {code.co_name}()")
                        break
            if counted is not None:
                plain = _plain(variables, code.co_name)
                if plain is not None:
                    counted["window_counted"] = plain
    if found is None:
        return None
    _invoked(frames, counted)
    return _result(*found)


def _invoked(frames: list | None, counted: dict | None, holder=None) -> None:
    """Under "window_frame" of `counted`: the count of the innermost program frame's invocation, the same for every
    call made in one run of that function (checks/handed.py: a function attending the same queries twice, within the
    window and past it, attends them by two branches). Where a module's attribute states the window (`holder`), the
    run of that module's own forward among the frames, where it is one of them: the calls its submodules make are
    its branches too (native sparse attention's sliding branch, a LocalAttention inside the module holding
    `sliding_window_size`, beside the selected blocks it attends itself)."""
    if counted is None or not frames:
        return
    frame = frames[0][0]
    if holder is not None:
        code = getattr(getattr(type(holder), "forward", None), "__code__", None)
        frame = next((f for f, _ in frames if f.f_code is code), frame)
    if frame is not _INVOKED[0]:
        _INVOKED[0] = frame
        _INVOKED[1] += 1
    counted["window_frame"] = _INVOKED[1]


POSITIONS = ("cur_pos", "current_pos", "cur_position", "start_pos", "input_pos", "past_len", "past_length")
LENGTHS = ("seq_len", "context_len", "kv_len", "kv_seqlen", "kv_seqlens", "seq_length", "context_length")


def _kind(code, skip: tuple[str, ...]) -> tuple[bool, bool]:
    """(the program's own, names a window) of a code object (co_varnames is built anew at each read: once per code)."""
    kind = _CODES.get(code)
    if kind is None:
        kind = _CODES.put(code, (not code.co_filename.startswith(skip), not _NAMES.isdisjoint(code.co_varnames)))
    return kind


def _plain(variables: dict, function: str) -> tuple | None:
    """(name, W, p, where) of a frame holding a plain int window and the int position of its query, else None."""
    for name in ("sliding_window", "window_size"):
        window = variables.get(name)
        if type(window) is int and (window > 0 or window == -1):  # (-1: the layer states it has none)
            for position in POSITIONS:
                at = variables.get(position)
                if type(at) is int and at >= 0:
                    return name, window, at, f"{name} = {window} and {position} = {at} in {function}()"
            for length in LENGTHS:  # (the tokens of the query's sequence, its own the last: p = length - 1)
                held = variables.get(length)
                if type(held) is int and held > 1:
                    return name, window, held - 1, f"{name} = {window} and {length} = {held} in {function}()"
    return None


def _result(name: str, said, where: str) -> tuple | None:
    return None if said is NONE else (name, said[0], said[1], where)


_CONTEXTS = ByCode()  # code object -> the names it uses that may hold an attention context


_PLAIN: set = set()  # the names read that name no attention context (each running module's names, every call)


def _context_name(name: str) -> bool:
    said = "context" in name.lower() and "att" in name.lower()
    if not said:
        _PLAIN.add(name)
    return said


def _context_names(code) -> tuple[str, ...]:
    names = _CONTEXTS.get(code)
    if names is None:
        used = code.co_varnames + (code.co_names if code.co_name == "<module>" else ())
        names = _CONTEXTS.put(code, tuple(n for n in used if _context_name(n)))
    return names


def _pair(value) -> tuple[int, int] | None:
    """(left, right) of an attention context stated as a pair of whole numbers (NeMo's `att_context_size=[4, 1]`,
    left -1 for unlimited), where it states a look-ahead (right >= 1); None otherwise."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(x) is int for x in value) \
            and value[0] >= -1 and value[1] >= 1:
        return value[0], value[1]
    return None


def look_ahead(stack: list, frames: list) -> tuple[int, int, str] | None:
    """(left, right, where) of the attention context the program states at the call: an attribute of a running module,
    outermost first, else a variable of a program frame (its locals, or a module's top level), outermost first, whose
    name says an attention context (`att_context_size`, `ATT_CONTEXT`) and whose value is a (left, right) pair of
    whole numbers with a look-ahead of right >= 1 keys after the query (checks/lookahead.py: later keys within it are
    the program's word, no causal mask's slip)."""
    for module in stack:
        own = vars(module)
        left = own.keys() - _PLAIN  # (a set difference: most modules' names were all read before, none is left)
        for name in own if left else ():  # (in the module's own order)
            if name in left and _context_name(name) and (said := _pair(own[name])) is not None:
                return *said, f"self.{name}={list(said)} of {type(module).__name__}"
    found = None
    for frame, _ in frames:
        for name in _context_names(frame.f_code):
            variables = frame.f_globals if frame.f_code.co_name == "<module>" else frame.f_locals
            said = _pair(variables.get(name))
            if said is not None:
                where = "at the top of the program" if frame.f_code.co_name == "<module>" else f"in {frame.f_code.co_name}()"
                found = (*said, f"{name}={list(said)} {where}")
    return found
