"""The positions a program frame states for an attention call's queries: a `position_ids` its function holds.

A hand-written model numbers its tokens (`position_ids`, `positions`, `pos_ids`) in the function that rotates its
queries and keys and calls the attention, or in the one that called it, where no outermost module call was handed
them (pi0/pi05's `PaliGemmaWithExpertModel.forward`, called as `.forward` from a sampling loop). Read in the two
innermost program frames, only where a local of those names is an integer tensor of as many positions as the call
has queries (one per batch row, or one row for all); the same tensor, handed to every layer, is copied once (kept by
the tensor's id, its weak reference and version). checks/cachedpositions.py reads the positions a prefill stated for the keys it cached against those a
later step states for its queries.
"""

from __future__ import annotations

import weakref

import torch

NAMES = ("position_ids", "positions", "pos_ids", "pos")
FRAMES = 2  # the attention's function and the one that called it
_READ: dict = {}  # id(tensor) -> (weakref to it, its version, int64 numpy (rows, Lq)) (a tensor's == is elementwise)


def _rows(held: torch.Tensor, batch: int, q_len: int):
    """int64 numpy (rows, Lq) of an integer tensor of Lq positions per row (rows 1 or the batch); None otherwise."""
    if held.dtype.is_floating_point or held.dtype.is_complex or held.dtype == torch.bool or held.device.type == "meta":
        return None
    if held.dim() == 1:
        held = held[None]
    if held.dim() != 2 or held.shape[-1] != q_len or held.shape[0] not in (1, batch):
        return None
    try:
        version = held._version
        got = _READ.get(id(held))
        if got is not None and got[0]() is held and got[1] == version:
            return got[2]
        found = held.detach().to("cpu", torch.int64).numpy().copy()
        if len(_READ) >= 64:
            _READ.clear()
        _READ[id(held)] = (weakref.ref(held), version, found)
        return found
    except (TypeError, RuntimeError):
        return None


def note(details: dict, walked, shape: tuple) -> None:
    """details["query_positions"] = {"rows": int64 (rows, Lq), "name", "function"} where one of the call's two innermost
    program frames holds its queries' positions."""
    if walked is None or len(shape) != 4 or shape[2] < 1:
        return
    batch, q_len = int(shape[0]), int(shape[2])
    for frame, _ in walked.held[:FRAMES]:
        variables = frame.f_locals
        for name in NAMES:
            held = variables.get(name)
            if type(held) is not torch.Tensor:
                continue
            if held.dim() >= 3:
                return  # (2-D or multimodal positions held beside it, ChatGLM's (B, 2, L): no one numbering to read)
            rows = _rows(held, batch, q_len)
            if rows is not None:
                code = frame.f_code
                details["query_positions"] = {"rows": rows, "name": name,
                                             "function": getattr(code, "co_qualname", code.co_name)}
                return
