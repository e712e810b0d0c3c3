"""The positions a program frame states for an attention call's queries: a `position_ids` its function holds.

A hand-written model numbers its tokens (`position_ids`, `positions`, `pos_ids`) in the function that rotates its
queries and keys and calls the attention, or in the one that called it, where no outermost module call was handed
them (pi0/pi05's `PaliGemmaWithExpertModel.forward`, called as `.forward` from a sampling loop), or in the outermost
module's own forward, which embeds the tokens and hands the layers its hidden states (MosaicGPT's `pos`, counted past
the left padding and looked up in `wpe`, mosaicml/examples#257). Read in the two innermost program frames and that one,
only where a local of those names is an integer tensor of as many positions as the call
has queries (one per batch row, or one row for all); the same tensor, handed to every layer, is copied once (kept by
the tensor's id, its weak reference and version). checks/cachedpositions.py reads the positions a prefill stated for the keys it cached against those a
later step states for its queries.
"""

from __future__ import annotations

import re
import weakref

import torch

NAMES = ("position_ids", "positions", "pos_ids", "pos")
FRAMES = 2  # the attention's function and the one that called it
_POSITION = re.compile(r"^(?:wpe|pos_?emb\w*|\w*position\w*|embed_pos\w*)$", re.I)
_EMBEDS: dict = {}  # id(module) -> (weakref to it, whether it holds a position table)
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


def _embeds_positions(module) -> bool:
    """The module looks its tokens' positions up in a table of its own (an nn.Embedding named for positions: GPT-2's
    and MosaicGPT's `wpe`, `position_embeddings`, `embed_positions`): the positions its forward numbers are the ones
    embedded, which no layer moves on (a rotary model's layers may offset theirs: EAGLE-3's steps)."""
    got = _EMBEDS.get(id(module))
    if got is None or got[0]() is not module:
        found = any(isinstance(m, torch.nn.Embedding) and _POSITION.search(name.rsplit(".", 1)[-1])
                    for name, m in module.named_modules())
        if len(_EMBEDS) >= 64:
            _EMBEDS.clear()
        got = _EMBEDS[id(module)] = (weakref.ref(module), found)
    return got[1]


def _outer(walked):
    """The outermost module call's module, where it looks positions up in a table of its own (_embeds_positions)."""
    modules = (frame.f_locals.get("self") for frame in reversed(walked.calls))  # (a CLI's own `__call__`s outside)
    outer = next((module for module in modules if isinstance(module, torch.nn.Module)), None)
    return outer if outer is not None and _embeds_positions(outer) else None


def _frames(walked):
    """(frame, whether it is the forward of a module that embeds its positions) of the two innermost program frames,
    then of that module's forward where it is not one of them."""
    outer, looked = None, False
    for frame, _ in walked.held[:FRAMES]:
        if frame.f_code.co_name == "forward" and "self" in frame.f_code.co_varnames:
            outer, looked = _outer(walked), True
            yield frame, outer is not None and frame.f_locals.get("self") is outer
        else:
            yield frame, False
    outer = outer if looked else _outer(walked)
    for frame, _ in walked.held[FRAMES:] if outer is not None else ():
        if frame.f_code.co_name == "forward" and frame.f_locals.get("self") is outer:
            yield frame, True
            return


def note(details: dict, walked, shape: tuple) -> None:
    """details["query_positions"] = {"rows": int64 (rows, Lq), "name", "function", "embedded"} where one of the call's
    program frames read (_frames) holds its queries' positions; embedded: the frame is the forward of the module that
    looks them up in its position table."""
    if walked is None or len(shape) != 4 or shape[2] < 1:
        return
    batch, q_len = int(shape[0]), int(shape[2])
    for frame, embedded in _frames(walked):
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
                details["query_positions"] = {"rows": rows, "name": name, "embedded": embedded,
                                             "function": getattr(code, "co_qualname", code.co_name)}
                return
