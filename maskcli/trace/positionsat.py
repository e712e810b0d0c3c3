"""The positions a program frame states for an attention call's queries: a `position_ids` its function holds.

A hand-written model numbers its tokens (`position_ids`, `positions`, `pos_ids`) in the function that rotates its
queries and keys and calls the attention, or in the one that called it, where no outermost module call was handed
them (pi0/pi05's `PaliGemmaWithExpertModel.forward`, called as `.forward` from a sampling loop), or in the forward of
the innermost running module that holds a position table, which embeds the tokens and hands the layers its hidden
states (MosaicGPT's `pos`, counted past the left padding and looked up in `wpe`, mosaicml/examples#257; a library's
too, transformers' GPT2Model). Read in the two innermost program frames and that one, only where a local of those
names is an integer tensor of as many positions as the call has queries (one per batch row, or one row for all); the
same tensor, handed to every layer, is copied once (kept by the tensor's id, its weak reference and version).
Where that module takes positions and the program's own call handed it none, the numbering is its default, the
column (OpenRLHF#217's reward model over left-padded rows): noted as unhanded. checks/cachedpositions.py reads the
positions a prefill stated for the keys it cached against those a later step states for its queries.
"""

from __future__ import annotations

import inspect
import os
import re
import weakref

import numpy as np
import torch

import maskcli.trace.held as held_module
import maskcli.trace.mropeused as mropeused

NAMES = ("position_ids", "positions", "pos_ids", "pos")
STARTS = ("start_pos", "input_pos", "position", "pos", "seqlen_offset", "offset", "offsets")  # an int parameter: the first query's position
OFFSETS = ("seqlen_offset",)  # a local too: the tokens before the queries, as the function read them off its cache
# (fla's attention layers, `seqlen_offset = past_key_values.get_seq_length(self.layer_idx)`, no loop counts with it)
FRAMES = 3  # the attention's function, the one that called it and its caller (a softmax helper of its own: tiny-llm's)
POSITION = re.compile(r"^(?:wpe|pos_?emb\w*|\w*position\w*|embed_pos\w*)$", re.I)
_EMBEDS: dict = {}  # id(module) -> (weakref to it, whether it holds a position table)
_ACCEPTS: dict = {}  # forward's function -> the place of its positions parameter, -1 for none (_accepts)
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_TORCH = os.path.dirname(torch.__file__)
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
        if held.is_inference():  # (made under inference_mode: no version counter to key a copy by, read each time)
            return held.detach().to("cpu", torch.int64).numpy().copy()
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


def _appended(variables: dict, batch: int, q_len: int):
    """int64 numpy (rows, Lq): the queries' positions flash_attn_with_kvcache's API states, each row's new keys `k`
    (B, new, H, D) appended after its `cache_seqlens` cached ones and the queries the last of them (none appended:
    the last `Lq` of the cached); None where its lengths are not one per row."""
    lengths = _rows(variables["cache_seqlens"], batch, batch)
    new = variables.get("k")
    new = int(new.shape[1]) if type(new) is torch.Tensor and new.dim() == 4 else 0
    if lengths is None or lengths.shape[0] != 1:
        return None
    return lengths.reshape(-1, 1) + new - q_len + np.arange(q_len)[None, :]


def _embeds_positions(module) -> bool:
    """The module looks its tokens' positions up in a table of its own (an nn.Embedding named for positions: GPT-2's
    and MosaicGPT's `wpe`, `position_embeddings`, `embed_positions`): the positions its forward numbers are the ones
    embedded, which no layer moves on (a rotary model's layers may offset theirs: EAGLE-3's steps)."""
    got = _EMBEDS.get(id(module))
    if got is None or got[0]() is not module:
        found = any(isinstance(m, torch.nn.Embedding) and POSITION.search(name.rsplit(".", 1)[-1])
                    for name, m in module.named_modules())
        if len(_EMBEDS) >= 64:
            _EMBEDS.clear()
        got = _EMBEDS[id(module)] = (weakref.ref(module), found)
    return got[1]


def _outer(walked):
    """(module, its module call's frame) of the innermost running module that looks positions up in a table of its own
    (_embeds_positions): the model that embeds its tokens (GPT2Model under a reward model's head, MosaicGPT), whose
    forward numbers them; (None, None) where none does."""
    for frame in walked.calls:
        module = frame.f_locals.get("self")
        if isinstance(module, torch.nn.Module) and _embeds_positions(module):
            return module, frame
    return None, None


def _frames(walked):
    """(frame, whether it is the forward of a module that embeds its positions) of the two innermost program frames,
    then of that module's forward where it is not one of them (a library's too: transformers' GPT2Model.forward, found
    on the way out from the attention to the module's call)."""
    inner = [frame for frame, _ in walked.held[:FRAMES]]
    outside = _outside_handed(walked)
    if outside:  # (the program's frames around a model call it handed positions: their own, not the model's)
        inner = [frame for frame in inner if id(frame) not in outside]
    outer, call = _outer(walked) if walked.calls else (None, None)
    for frame in inner:
        yield frame, outer is not None and frame.f_code.co_name == "forward" and frame.f_locals.get("self") is outer
    if outer is None:
        return
    frame, found = walked.calls[0], None
    while frame is not None and frame is not call:
        if frame.f_code.co_name == "forward" and frame.f_locals.get("self") is outer:
            found = frame
        frame = frame.f_back
    if found is not None and all(found is not f for f in inner):
        yield found, True


def _outside_handed(walked) -> set:
    """ids of the frames outside the outermost module call where that call was handed positions (a tensor by one of
    NAMES): a loop around it may hold other ones (lerobot's pi0+FAST keeps its 0-indexed prefix positions and hands
    PaliGemma the 1-indexed ones its prepare_inputs_for_generation makes); empty where it was handed none."""
    frame = next((f for f in reversed(walked.calls) if f.f_code is _CALL_IMPL), None) if walked.calls else None
    if frame is None:
        return set()
    module, args = frame.f_locals.get("self"), frame.f_locals.get("args", ())
    kwargs = frame.f_locals.get("kwargs") or {}
    at = _accepts(module.forward) if isinstance(module, torch.nn.Module) else None
    handed = any(type(kwargs.get(name)) is torch.Tensor for name in NAMES) \
        or at is not None and len(args) > at and type(args[at]) is torch.Tensor
    found, frame = set(), frame.f_back if handed else None
    while frame is not None and len(found) < 64:
        found.add(id(frame))
        frame = frame.f_back
    return found


def _library(filename: str) -> bool:
    """Code not the program's: torch's, maskcli's, the standard library's, an installed package's, `<...>`."""
    return filename.startswith((*(held_module._SKIP or held_module._skipped()), "<")) or "-packages" + os.sep in filename


def _accepts(forward) -> int | None:
    """The place among its arguments (self left out) of the parameter named for positions (NAMES) that `forward`
    takes; None where it takes none (read once per function: a decorator's wrapper shares its code with others)."""
    function = getattr(forward, "__func__", forward)
    got = _ACCEPTS.get(function)
    if got is None:
        try:
            names = list(inspect.signature(forward).parameters)
        except (TypeError, ValueError):
            names = []
        got = next((i for i, name in enumerate(names) if name in NAMES), -1)
        if len(_ACCEPTS) >= 256:
            _ACCEPTS.clear()
        _ACCEPTS[function] = got
    return None if got < 0 else got


def _unhanded(outer, call, walked) -> bool:
    """The program called the model (the outermost module call is made from its own code, not a library's generation
    loop), and the module that holds the position table takes positions (`position_ids`) yet was handed none: the
    program left its model to number its tokens by column. A forward that takes none (a hand-written GPT's `arange`)
    states that numbering itself."""
    if call.f_code is not _CALL_IMPL:
        return False
    at = _accepts(outer.forward)
    args, kwargs = call.f_locals.get("args", ()), call.f_locals.get("kwargs") or {}
    if at is None or any(kwargs.get(name) is not None for name in NAMES) or (len(args) > at and args[at] is not None):
        return False
    frame = next(frame for frame in reversed(walked.calls) if frame.f_code is _CALL_IMPL).f_back  # (the outermost)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back  # (nn.Module's _wrapped_call_impl)
    return frame is not None and not _library(frame.f_code.co_filename)


def note(details: dict, walked, shape: tuple, outer=None) -> None:
    """details["query_positions"] = {"rows": int64 (rows, Lq), "name", "function", "embedded", "unhanded"} where one of
    the call's program frames read (_frames) holds its queries' positions; embedded: the frame is the forward of the
    module that looks them up in its position table; unhanded: that module takes positions and the program's call
    handed it none (_unhanded)."""
    mropeused.note(details, walked, shape, outer)  # (the multimodal rope positions a forward holds: flatgrid.py)
    if walked is None or len(shape) != 4 or shape[2] < 1:
        return
    batch, q_len = int(shape[0]), int(shape[2])
    for frame, embedded in _frames(walked):
        variables, code = frame.f_locals, frame.f_code
        if "k_cache" in variables and type(variables.get("cache_seqlens")) is torch.Tensor:
            rows = _appended(variables, batch, q_len)  # (flash_attn_with_kvcache's arguments, or a stand-in's)
            if rows is not None:
                details["query_positions"] = {"rows": rows, "name": "cache_seqlens", "embedded": False,
                                             "unhanded": False, "function": getattr(code, "co_qualname", code.co_name)}
                return
        handed = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        start = next(((name, variables[name]) for name in STARTS if (name in handed or name in OFFSETS)
                      and type(variables.get(name)) is int and 0 <= variables[name] < 1 << 40), None)
        # (a parameter the function was handed, no loop's; or an offset it read of its cache, fla's seqlen_offset)
        if start is not None and not any(type(variables.get(name)) is torch.Tensor for name in NAMES):
            # (Meta llama's `start_pos`, a decoder's `position` handed to its RoPE: the queries run on from it, one row)
            details["query_positions"] = {
                "rows": start[1] + np.arange(q_len, dtype=np.int64)[None, :], "name": start[0], "embedded": embedded,
                "unhanded": False, "function": getattr(code, "co_qualname", code.co_name)}
            return
        for name in NAMES:
            held = variables.get(name)
            if type(held) is not torch.Tensor:
                continue
            if held.dim() >= 3:
                return  # (2-D or multimodal positions held beside it, ChatGLM's (B, 2, L): no one numbering to read)
            rows = _rows(held, batch, q_len)
            if rows is not None:
                unhanded = embedded and _unhanded(*_outer(walked), walked)
                details["query_positions"] = {"rows": rows, "name": name, "embedded": embedded,
                                             "unhanded": bool(unhanded),
                                             "function": getattr(code, "co_qualname", code.co_name)}
                return
