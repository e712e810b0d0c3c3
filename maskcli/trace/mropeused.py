"""The multimodal rope positions a model rotated a prefill with, as its own forward holds them (checks/flatgrid.py).

Qwen2-VL's family rotates each token by three positions, (t, h, w), a (3, B, L) `position_ids` its language model's
forward holds once it has them: handed by the program, or made by the forward itself where it was handed none
(`get_rope_index` from the image grid, or, in older code, the cache positions copied into t, h and w alike). Read at
an attention call of more than one query: from the innermost module call outward, the first `forward` frame whose
code names `position_ids` and holds there an integer tensor of 3 or 4 rows over the call's queries (at most FRAMES
frames; each code asked once whether it names them). The same tensor, handed to every layer, is copied once (kept by
its id, weak reference and version).
"""

from __future__ import annotations

import weakref

import torch

FRAMES = 48  # frames read outward from the innermost module call
MOST = 1 << 20  # elements of positions copied at most
_NAMES: dict = {}  # id(code) -> (code, whether it is a forward that names position_ids)
_READ: dict = {}  # id(tensor) -> (weakref to it, its version, int64 numpy (C, B, L))


def _copy(held: torch.Tensor):
    """int64 numpy (C, B, L) of the positions, copied once per tensor and version."""
    if held.is_inference():
        return held.detach().to("cpu", torch.int64).numpy().copy()
    got = _READ.get(id(held))
    if got is not None and got[0]() is held and got[1] == held._version:
        return got[2]
    found = held.detach().to("cpu", torch.int64).numpy().copy()
    if len(_READ) >= 16:
        _READ.clear()
    _READ[id(held)] = (weakref.ref(held), held._version, found)
    return found


def note(details: dict, walked, shape: tuple) -> None:
    """details["mrope_used"] = {"rows": int64 (C, B, L), "function"} where a module's forward running the call holds
    multimodal rope positions over its queries."""
    if walked is None or not walked.calls or len(shape) != 4 or shape[2] < 2:
        return
    q_len, frame, names = int(shape[2]), walked.calls[0], _NAMES
    for _ in range(FRAMES):
        if frame is None:
            return
        code = frame.f_code
        got = names.get(id(code))
        if got is None or got[0] is not code:
            if len(names) >= 4096:
                names.clear()
            got = names[id(code)] = (code, code.co_name == "forward" and "position_ids" in code.co_varnames)
        if got[1]:
            held = frame.f_locals.get("position_ids")
            if type(held) is torch.Tensor and held.dim() == 3 and held.shape[0] in (3, 4) and held.shape[-1] == q_len \
                    and not held.is_floating_point() and held.dtype != torch.bool and held.numel() <= MOST \
                    and held.device.type != "meta":
                details["mrope_used"] = {"rows": _copy(held),
                                         "function": getattr(code, "co_qualname", code.co_name)}
                return
        frame = frame.f_back
