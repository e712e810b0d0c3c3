"""The multimodal rope positions a model rotated a prefill with, as its own forward holds them (checks/flatgrid.py).

Qwen2-VL's family rotates each token by three positions, (t, h, w), a (3, B, L) `position_ids` its language model's
forward holds once it has them: handed by the program, or made by the forward itself where it was handed none
(`get_rope_index` from the image grid, or, in older code, the cache positions copied into t, h and w alike). Read
once per outermost module call whose module's config states multimodal rope (an `mrope_section`), at its first attention
call of more than one query whose frames hold them: from the innermost module call outward, the first `forward` frame
whose code names `position_ids` and holds there an integer tensor of 3 or 4 rows over the call's queries (at most
FRAMES frames; each code asked once whether it names them). Kept with what the outermost call holds (outer.py), so
that its Top carries it; every other model pays one lookup a call.
"""

from __future__ import annotations

import weakref

import torch

from maskcli.checks.flatgrid import multimodal_rope
from maskcli.checks.intent import read
from maskcli.trace.padded import MOST  # (elements of one argument read at most, tops.py's one limit)

FRAMES = 48  # frames read outward from the innermost module call
_NAMES: dict = {}  # id(code) -> (code, whether it is a forward that names position_ids)
_MODULES: dict = {}  # id(module) -> (weakref to it, whether its config states multimodal rope)


def _stated(module) -> bool:
    """The module's config (or its text part) states multimodal rope (an `mrope_section`), asked once per module."""
    got = _MODULES.get(id(module))
    if got is None or got[0]() is not module:
        if len(_MODULES) >= 64:
            _MODULES.clear()
        got = _MODULES[id(module)] = (weakref.ref(module), multimodal_rope(read(module, "config")))
    return got[1]


def note(details: dict, walked, shape: tuple, outer) -> None:
    """outer's kept["mrope_used"] = {"rows": int64 (C, B, L), "function"}: once per outermost call (`outer`, outer.py's
    held list) of a module whose config states multimodal rope, the first of its attention calls over more than one
    query whose frames hold such positions over its queries (a module's forward running it)."""
    if outer is None or walked is None or not walked.calls or len(shape) != 4 or shape[2] < 2 \
            or not isinstance(outer[6], dict) or "mrope_used" in outer[6] or not _stated(outer[1]):
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
                outer[6]["mrope_used"] = {"rows": held.detach().to("cpu", torch.int64).numpy().copy(),
                                          "function": getattr(code, "co_qualname", code.co_name)}
                return
        frame = frame.f_back
