"""A causal word written into the program's own call on the way to the kernel: `flash_attn_func(q, k, v, causal=False)`.

Between the innermost running module's forward and the kernel, the program may call its own helpers (a flash-attn
shim, an attention function): where one of those calls, as its source is written, hands `causal=` / `is_causal=` a
literal True or False, that is the program's word on this call's direction, whatever the helper does with it
(nanochat#805: the SDPA fallback never received `causal=False` and ran `is_causal=True`). Read from the source line
each program frame is at (ast, once per file), matched to the call into the next frame inward by the callee's name;
the kernel's own call line is not read (its flag is the kernel's, not a word about it). Left out: a call that also
hands a mask by keyword (its cells may carry the triangle), or whose callee holds a square (..., L, L) mask tensor
(a causal mask handed beside `causal=False` is the program's own choice). checks/callcausal.py reads False.
"""

from __future__ import annotations

import ast
import functools
import linecache

import torch

NAMES = ("causal", "is_causal")
MASKS = ("mask", "bias")  # words of a parameter or keyword that may hand the kernel cells of its own
READ = 4  # program frames read outward from the kernel's caller where no module is running


@functools.lru_cache(maxsize=512)
def _literal_calls(filename: str) -> dict:
    """line -> [(callee name, keyword, value, masked)] of every call in the file handing NAMES a literal bool."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    found: dict = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        said = [(k.arg, k.value.value) for k in node.keywords
                if k.arg in NAMES and isinstance(k.value, ast.Constant) and isinstance(k.value.value, bool)]
        if not said:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name is None:
            continue
        masked = any(k.arg and any(w in k.arg for w in MASKS) and not (isinstance(k.value, ast.Constant)
                                                                       and k.value.value is None) for k in node.keywords)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            found.setdefault(line, []).append((name, *said[0], masked))
    return found


def _square_mask(frame, length: int) -> bool:
    """The callee frame holds a parameter named like a mask that is a tensor over (..., length, length)."""
    code = frame.f_code
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        if any(w in name for w in MASKS):
            value = frame.f_locals.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == value.shape[-2] == length:
                return True
    return False


def called_flag(stack: list, walked, length: int) -> dict | None:
    """{"said": "Class.forward: f(causal=False)", "causal": False} where a program frame between the innermost running
    module's forward (included) and the kernel's caller (excluded) calls the next frame inward with a literal
    causal / is_causal; the innermost such call speaks. None where none does."""
    if walked is None:
        return None
    frames = [frame for frame, _ in walked.windows]
    module = stack[-1] if stack else None
    if not frames or module is not None and frames[0].f_locals.get("self") is module:
        return None  # (the module's forward calls the kernel itself: its line is the kernel's)
    for depth, (inner, outer) in enumerate(zip(frames, frames[1:])):
        if module is None and depth >= READ:
            return None
        here = _literal_calls(outer.f_code.co_filename).get(outer.f_lineno, ())
        callee = inner.f_code.co_name
        said = next((one for one in here if one[0] == callee), None)
        if said is not None:
            if said[3] or _square_mask(inner, length):
                return None
            owner = outer.f_locals.get("self")
            where = f"{type(owner).__name__}.{outer.f_code.co_name}" if owner is not None else outer.f_code.co_name
            return {"said": f"{where}: {callee}(..., {said[1]}={said[2]})", "causal": said[2]}
        if module is not None and outer.f_locals.get("self") is module:
            return None
    return None


def note(details: dict, stack: list, walked, shape: tuple) -> None:
    """details["call_causal"] of one attention call (shape: its (B, H, Lq, Lk)) of several queries, no more than its
    keys (a chunk's queries against earlier keys too: checks/own.py and steps.py hold a literal causal=False there)."""
    if len(shape) != 4 or shape[2] > shape[3] or shape[2] < 2:
        return
    try:
        said = called_flag(stack, walked, int(shape[3]))
    except Exception:  # noqa: BLE001 - a frame maskcli cannot read says nothing
        said = None
    if said is not None:
        details["call_causal"] = said
