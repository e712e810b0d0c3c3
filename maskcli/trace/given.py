"""A mask the program handed to the function that attends, read beside what the kernel masked (checks/dropped.py).

At each attention call, the nearest program frames (the function that called the kernel and its callers, torch's
and maskcli's left out) are looked at for a parameter named like an attention mask (NAMES, a name ending in SUFFIXES,
such an entry of its `**kwargs`: _parameters) that holds an additive float mask over exactly the call's (Lq, Lk): -inf
or at most -1e4 masks a cell (a bool mask's polarity is not known here, so it is left alone; axes of 1 between its
batch and its cells are read away: MaxText's (b, 1, 1, t, s); a 3-D (N, Lq, Lk) mask is read per head, as torch
broadcasts it, and per batch row, as a program that unsqueezes it or adds it to scores permuted batch-first does:
dropped only where the kernel keeps to neither), or an xformers-style block-diagonal mask object
(`BlockDiagonalMask.from_seqlens`: its `seqlens`, or `q_seqinfo` / `k_seqinfo`'s `seqstart_py`, summing to the call's
keys), read as the blocks it keeps (mistral-inference#218: a vision block handed the images' mask that never passed it
on). Where the kernel sees a cell that mask masks, on a query row the mask leaves some key (a row it masks whole may be
unmasked on purpose, transformers' _unmask_unattended), the call records where: the program's own mask was dropped on
its way to the kernel (VeOmni#1051: a flash path that takes `causal` only). One comparison per distinct (mask tensor,
kernel mask). A frame that holds the kernel's own mask is not read for the others: the masks it chose against.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys

import numpy as np
import torch

import maskcli.trace.heldsinks as heldsinks
from maskcli.trace.crossing import CONTEXT_MASKS
from maskcli.trace.gathered import note as _gathered

CELLS = 1 << 22  # b*h*Lq*Lk past which nothing is compared (no L^2 work on a long sequence's call)
NAMES = ("attn_mask", "attention_mask", "attn_bias", "mask", "bias_mask")
SUFFIXES = ("_attn_mask", "_attention_mask")  # `self_attn_mask`, `cross_attention_mask`: an attention mask by name
FRAMES = 3  # program frames looked at: the attending function, its caller and theirs


def stored(trace, seen) -> str:
    """trace._store(seen) (its key), with seen.details["dropped_mask"] set where a mask the frames handed is dropped."""
    key = trace._store(seen)
    note(seen, trace, key, trace.__dict__.setdefault("_handed", {}))
    with contextlib.suppress(Exception, SystemExit):  # (a learned sink the attending module holds, no term of the mask)
        heldsinks.note(seen.details, trace.sites.stack, seen.api, seen.shape, seen.sources)
    return key


def note(seen, trace, key: str, cache: dict) -> None:
    """Set seen.details["dropped_mask"] where a mask the program's frames hand toward this call is not kept to (the
    kernel's mask: `key` in trace's store, maybe a copy not read yet: store.unread_cells)."""
    shape = tuple(map(int, seen.shape))
    stored = trace._masks.get(key)
    if math.prod(shape) > CELLS or stored is not None and stored.get("form") == "stats":  # (math's: numpy's costs more)
        return
    try:
        found = handed(shape, seen.sources, None if (reading := seen.details.get("cross")) is None else bool(reading.get("cross")))
        if found is not None:
            from maskcli.trace.store import unread_cells
            lost = dropped(found[:2], lambda: unread_cells(trace, key), shape, cache, key)
            if lost is not None:
                seen.details["dropped_mask"] = {**lost, "beside_memory_mask": True} if found[2] else lost
    except (Exception, SystemExit):  # noqa: BLE001 - a frame maskcli cannot read: the call is recorded all the same, without this
        pass


@functools.cache
def _skip() -> tuple[str, ...]:
    return (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<")


def gathered_keys(seen, key: torch.Tensor, unmasked: bool, query=None, mask=None, is_causal: bool = False) -> None:
    """At a kernel call that masks nothing (`unmasked`) with several queries: where its keys were gathered from a padded
    batch across the mask a frame holds beside it (trace/gathered.py). And at any call, where its keys are the tail
    of a longer key tensor (trace/sliced.py), a window of a cache buffer past the sink a frame states (trace/sinkslots.py),
    and where its mask is a block of rows of a square one (trace/maskrows.py)."""
    from maskcli.trace.maskrows import note as _rows
    from maskcli.trace.sinkslots import note as _sink
    from maskcli.trace.sliced import note as _sliced

    _sliced(seen.details, key, query)
    _sink(seen.details, key, _skip())
    if mask is not None:
        _rows(seen.details, mask, int(seen.shape[3]))
    if seen.shape[2] > 1 and (unmasked or seen.shape[0] == 1 and seen.shape[2] == seen.shape[3] and key.dim() == 3):
        try:  # (a masked call only of one sequence's square self-attention over (H, n, D) keys: a varlen stand-in's)
            _gathered(seen, key, None if unmasked else _kept(mask, is_causal, seen.shape[2]))
        except (Exception, SystemExit):  # noqa: BLE001 - a frame or tensor maskcli cannot read: the call is recorded without this
            pass


def _kept(mask, is_causal: bool, n: int) -> np.ndarray | None:
    """The (n, n) cells a one-sequence call keeps: its bool or additive mask (any head: one broadcast over them), its
    is_causal; None where it is no such mask."""
    from maskcli.inspect.polarity import additive_keep

    causal = np.tril(np.ones((n, n), dtype=bool)) if is_causal else True
    if mask is None:
        return causal if is_causal else None
    if type(mask) is not torch.Tensor or tuple(mask.shape[-2:]) != (n, n) or mask.numel() != n * n:
        return None
    cells = mask.detach().reshape(n, n)
    cells = cells if cells.dtype == torch.bool else additive_keep(cells) if cells.is_floating_point() else cells != 0
    return cells.cpu().numpy() & causal


def handed(shape: tuple, sources: tuple, crossing: bool | None = False) -> tuple[str, torch.Tensor, bool] | None:
    """('parameter in function()', tensor, beside) of the nearest program frame's float mask over the call's (Lq, Lk)
    that is not one the kernel was given; None where there is none. A frame whose function takes its memory's mask
    (crossing.CONTEXT_MASKS: `encoder_attention_mask`) is read, at a cross-attention (`crossing`), for that mask alone;
    where the call is not known for one yet (None), its other mask is returned with `beside` True (checks/dropped.py
    leaves it to a call it reads as cross-attention)."""
    q_len, k_len = int(shape[2]), int(shape[3])
    if q_len < 2:
        return None
    skip, frame, searched, either = _skip(), sys._getframe(1), 0, None
    own = {id(x) for x in sources}
    while frame is not None:
        program = not frame.f_code.co_filename.startswith(skip)
        if program and searched == FRAMES:
            break
        handed_on = () if program or not searched else _module_arguments(frame)
        if program or handed_on:
            searched += program
            code = frame.f_code
            label = f"{code.co_name}()" if program else f"{type(frame.f_locals['self']).__name__}'s call"
            memory = crossing is not False and _takes_memory_mask(
                getattr(type(frame.f_locals["self"]).forward, "__code__", None) if handed_on else code)
            params = handed_on or _parameters(frame, code)  # (none where the frame holds the kernel's own mask: the
            for name, value in () if any(id(v) in own for _, v in params) else params:  # rest it chose against, Llama 4)
                beside = memory and name.split()[0] not in CONTEXT_MASKS
                if id(value) in own or beside and crossing:
                    continue  # (the kernel's own mask, however it is viewed below; or, at a cross-attention, the
                    # queries' own mask of a layer that states its memory's mask beside it: BART's, TrOCR's layer
                    # forward(attention_mask, encoder_attention_mask), the first handed to its self-attention only)
                if issubclass(type(value), torch.Tensor) and value.dtype == torch.bool and name.split()[0] not in NAMES \
                        and value.dim() == 2 and tuple(value.shape) == (q_len, k_len) and q_len > 2:
                    value = value[None, None]  # (one (Lq, Lk) bool mask for every row and head: MapTR's self_attn_mask;
                    # a plain `mask` of that shape is as often the one the function just made for the kernel itself)
                if issubclass(type(value), torch.Tensor) and id(value) not in own and value.is_floating_point() \
                        and value.dim() >= 2 and (tuple(value.shape[-2:]) == (q_len, k_len) or _keys_over(value, shape)):
                    return f"{name} of {label}", value, beside
                if either is None and issubclass(type(value), torch.Tensor) and id(value) not in own \
                        and _bool_over(value, shape):  # (an additive mask a caller handed, its polarity known, wins:
                    either = f"{name} of {label} (bool, read either way round)", _four(value), beside  # the bool came of it)
                    continue
                blocks = None if value is None or issubclass(type(value), torch.Tensor) or id(value) in own \
                    else block_diagonal(value, q_len, k_len)
                if blocks is not None:
                    return f"{name} of {label} ({type(value).__name__})", blocks, beside
        frame = frame.f_back
    return either


def _takes_memory_mask(code) -> bool:
    """The function (or the module's forward, where a module was handed the mask) takes its memory's mask by name
    (crossing.CONTEXT_MASKS: `encoder_attention_mask`): beside it, its `attention_mask` is the queries' own."""
    if code is None:
        return False
    return not set(CONTEXT_MASKS).isdisjoint(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])


def _keys_over(value: torch.Tensor, shape: tuple) -> bool:
    """A 4-D float mask over the call's keys for every query, (B or 1, H or 1, 1, Lk): a key padding bias broadcast
    (LTX-2's `(1 - mask) * -10000` as [B, 1, 1, S_text], diffusers#14397)."""
    b, h, _, k_len = (int(x) for x in shape)
    return value.dim() == 4 and value.shape[0] in (1, b) and value.shape[1] in (1, h) and value.shape[2] == 1 \
        and value.shape[3] == k_len


def _parameters(frame, code) -> list:
    """(name, value) of the frame's parameters named like an attention mask: NAMES, a name ending in one of SUFFIXES
    (`self_attn_mask`, `cross_attention_mask`), and such entries of its `**kwargs` (a mask handed on through kwargs
    that a layer never reads: MapQR#12's self_attn_mask, passed to a DetrTransformerDecoderLayer that reads only
    attn_masks)."""
    count = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[:count]
    variables = frame.f_locals
    found = [(name, variables.get(name)) for name in NAMES if name in names]  # (NAMES' order first, as before)
    found += [(name, variables.get(name)) for name in names if name not in NAMES and name.endswith(SUFFIXES)]
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = variables.get(code.co_varnames[count + bool(code.co_flags & inspect.CO_VARARGS)])
        if isinstance(extra, dict):
            found += [(f"{name} in **kwargs", value) for name, value in extra.items()
                      if isinstance(name, str) and (name in NAMES or name.endswith(SUFFIXES))]
    return found


def _bool_over(value: torch.Tensor, shape: tuple) -> bool:
    """A bool mask laid out as the kernel takes one, (B or 1, H or 1, Lq or 1, Lk): over the call's cells, or over its
    keys for every query (a key padding mask broadcast: the Flux processor's [B, 1, 1, txt + img], diffusers#11065); or
    one of (B or 1, Lq, Lk), each batch row's cells, that the attending function unsqueezes over the heads itself
    (hepattn's `attn_mask.unsqueeze(-3)`), where Lq and Lk differ (a query set over another's keys: a square
    (B, L, L) bool is most often a key padding expanded over the queries, which checks/held.py reads as the padding)."""
    b, h, q_len, k_len = (int(x) for x in shape)
    if value.dtype == torch.bool and value.dim() == 3:
        return value.shape[0] in (1, b) and tuple(value.shape[1:]) == (q_len, k_len) and 1 < q_len != k_len
    return value.dtype == torch.bool and value.dim() == 4 and value.shape[0] in (1, b) and value.shape[1] in (1, h) \
        and value.shape[2] in (1, q_len) and value.shape[3] == k_len


def _four(value: torch.Tensor) -> torch.Tensor:
    """A (B|1, Lq, Lk) bool mask as (B|1, 1, Lq, Lk), as its function unsqueezes it; any other as it is."""
    return value[:, None] if value.dim() == 3 else value


def _module_arguments(frame) -> list:
    """(name, value) of the arguments named like an attention mask that a module was called with, read from torch's
    `Module._call_impl` frame that ran it (its `args` and `kwargs`, bound to the module's forward): the mask as the
    caller handed it, where the module's forward rebound its own parameter before attending (hepattn#148's decoder
    layer: `attn_mask = None` when built with mask_attention=False, the local window its decoder handed never applied).
    [] for any other frame."""
    if frame.f_code.co_name != "_call_impl" or not frame.f_code.co_filename.endswith("module.py"):
        return []
    variables = frame.f_locals
    module, args, kwargs = variables.get("self"), variables.get("args") or (), variables.get("kwargs") or {}
    if not isinstance(module, torch.nn.Module) or not isinstance(kwargs, dict):
        return []
    named = [(name, args[at]) for at, name in _mask_positions(type(module)) if at < len(args)]
    named += [(name, value) for name, value in kwargs.items() if isinstance(name, str) and _masklike(name)]
    return [(name, value) for name, value in named if value is not None]


def _masklike(name: str) -> bool:
    return name in NAMES or name.endswith(SUFFIXES)


@functools.cache
def _mask_positions(cls) -> tuple[tuple[int, str], ...]:
    """(index in a call's positional args, name) of each positional parameter of `cls.forward` named like an attention
    mask (its signature read once a class)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # (self)
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple((at, p.name) for at, p in enumerate(parameters) if p.kind in positional and _masklike(p.name))


def _starts(value, name: str) -> list[int] | None:
    """The block starts an attention-bias object states: `seqlens` (lengths) or `<name>.seqstart_py` (xformers')."""
    info = getattr(value, name, None)
    starts = getattr(info, "seqstart_py", None)
    if isinstance(starts, (list, tuple)) and len(starts) > 2 and all(isinstance(x, int) for x in starts):
        return list(starts)
    lengths = getattr(value, "seqlens", None)
    if isinstance(lengths, (list, tuple)) and len(lengths) > 1 and all(isinstance(x, int) and x > 0 for x in lengths):
        return [0, *np.cumsum(lengths).tolist()]
    return None


def block_diagonal(value, q_len: int, k_len: int) -> torch.Tensor | None:
    """An additive (Lq, Lk) mask (0 kept, -inf masked) of a block-diagonal attention-bias object over exactly these
    queries and keys (xformers' `BlockDiagonalMask`, or its `...CausalMask`: each block causal, top-left as xformers
    lays it); None for anything else. Only its attributes are read: no method of the program's object is called."""
    if "blockdiagonal" not in type(value).__name__.lower():
        return None
    q_starts, k_starts = _starts(value, "q_seqinfo"), _starts(value, "k_seqinfo")
    q_starts = q_starts or k_starts
    k_starts = k_starts or q_starts
    if q_starts is None or q_starts[-1] != q_len or k_starts[-1] != k_len or len(q_starts) != len(k_starts):
        return None
    q_block = np.searchsorted(np.asarray(q_starts), np.arange(q_len), side="right")
    k_block = np.searchsorted(np.asarray(k_starts), np.arange(k_len), side="right")
    keep = q_block[:, None] == k_block[None, :]
    if "causal" in type(value).__name__.lower():
        q_at = np.arange(q_len) - np.asarray(q_starts)[q_block - 1]
        k_at = np.arange(k_len) - np.asarray(k_starts)[k_block - 1]
        keep &= k_at[None, :] <= q_at[:, None]
    return torch.from_numpy(np.where(keep, 0.0, -math.inf).astype(np.float32))


def dropped(found: tuple[str, torch.Tensor], cells, shape: tuple, cache: dict, mask: str) -> dict | None:
    """{"name", "cell": (b, q, k), "cells"} where the kernel's keep `cells()` (b, h, Lq, Lk as stored, 1s broadcast)
    sees a cell the handed mask masks on a row it does not mask whole; None where the kernel keeps to it. `mask`: the
    kernel mask's key in the store (with the tensor's id and version, what the answer is cached by)."""
    name, tensor = found
    key = (id(tensor), object() if tensor.is_inference() else tensor._version, mask, name)  # (inference: no version)
    if key in cache and cache[key][0] is tensor:
        return cache[key][1]
    b, h, q_len, k_len = (int(x) for x in shape)
    if tensor.dtype == torch.bool:
        result = _either_way(name, tensor.detach().cpu().numpy(), cells(), q_len, k_len)
    else:  # (the kernel's cells built only here: the same mask tensor and kernel mask again is answered from the cache)
        result = _additive(name, tensor, cells(), b, h, q_len, k_len)
    if result is not None and q_len != k_len and tuple(tensor.shape[-2:]) == (q_len, k_len):
        result["queries_by_keys"] = True  # (over the cells of queries and keys of two lengths: not the queries' own
        # self-attention mask, which a cross-attention's frames hold too: checks/dropped.py reads it there)
    if len(cache) > 64:
        cache.clear()
    cache[key] = (tensor, result)
    return result


def _additive(name: str, tensor: torch.Tensor, kernel: np.ndarray, b: int, h: int, q_len: int, k_len: int) -> dict | None:
    """dropped()'s answer for a float (additive) mask: the cells the kernel sees that it masks, on rows it leaves some
    key; or, where the kernel keeps exactly the cells the mask holds 0 at (or exactly the others) and the mask is a bias
    (finite values it keeps, two or more of them besides 0), the cells it masks that the bias keeps: the bias read as a
    bool mask (pytorch#107084: MultiheadAttention's fast path cast an ALiBi attn_mask to bool, nonzero masked)."""
    from maskcli.inspect.polarity import additive_keep

    with torch.no_grad():
        kept = additive_keep(tensor.detach())
        values, keep = tensor.detach()[kept].unique(), kept.cpu()
    biased = len(values[values != 0]) >= 2
    if keep.all() and not biased:
        return None
    zero = (tensor.detach() == 0).cpu()
    best = None
    for reading, zeros in zip(_laid(keep, b, h, q_len, k_len), _laid(zero, b, h, q_len, k_len)):
        try:
            planes = np.broadcast_shapes(tuple(reading.shape), kernel.shape)
        except ValueError:
            continue
        if planes[0] not in (1, b) or planes[1] not in (1, h):
            continue
        given = np.broadcast_to(reading.numpy(), planes)
        seen = np.broadcast_to(kernel, planes)
        cast, zeros = given & ~seen, np.broadcast_to(zeros.numpy(), planes)
        if biased and cast.any() and ((seen == zeros).all() or (seen == ~zeros).all()):  # (nonzero masked, or kept)
            return {"name": name, "cell": [int(x) for x in np.argwhere(cast)[0]], "cells": int(cast.sum()),
                    "masked": int((~given).sum()), "cast": "masked" if seen[zeros].all() else "kept", "one_row": None}
        lost = seen & ~given & given.any(axis=-1, keepdims=True)
        if not lost.any():
            return None  # (the kernel keeps to this reading of the mask's axes)
        if best is None or int(lost.sum()) < best["cells"]:
            partial = given.any(axis=-1) & ~given.all(axis=-1)  # (rows the mask keeps some keys of and masks others)
            best = {"name": name, "cell": [int(x) for x in np.argwhere(lost)[0]], "cells": int(lost.sum()),
                    "masked": int((~given & given.any(axis=-1, keepdims=True)).sum()),
                    "inverted": bool(partial.any() and (seen == ~given)[partial].all()), "one_row": one_row(given, seen)}
    if best is not None and tensor.dim() == 4 and tensor.shape[2] == 1 < q_len and not best["inverted"]:
        return None  # (a key padding bias read for every query: only where the kernel keeps its very inverse; a padding
        # query under a finite fill sees the padding keys it is left, GPT-2's left-padded rows, and is no dropped mask)
    return best


def _laid(keep: torch.Tensor, b: int, h: int, q_len: int, k_len: int) -> list:
    """The readings of a mask's axes as (B|1, H|1, Lq, Lk); a (B, Lk) mask as long as the queries both as (Lq, Lk) and
    per batch row, a key padding mask (candle's e5 BertModel hands (B, L) where B == L: blind-zo)."""
    lead = tuple(keep.shape[:-2])
    if keep.dim() == 2 and tuple(keep.shape) == (b, k_len) and b == q_len > 1:
        return [keep.reshape(1, 1, q_len, k_len), keep.reshape(b, 1, 1, k_len)]
    if len(lead) == 1 and lead[0] == b * h and b * h > 1:  # (b * h, Lq, Lk): the heads folded into the batch
        return [keep.reshape(b, h, q_len, k_len)]
    if len(lead) > 2 and all(n == 1 for n in lead[1:-1]):  # (B, 1, ..., H|1, Lq, Lk): MaxText's (b, 1, 1, t, s)
        return [keep.reshape(lead[0], lead[-1], *keep.shape[-2:])]
    if len(lead) == 1 and lead[0] > 1:  # (N, Lq, Lk): per head as torch broadcasts it, or per batch row (unsqueezed,
        # or added to scores permuted batch first); the frame does not say which, so either may be kept to
        return [keep.reshape(lead[0], 1, q_len, k_len), keep.reshape(1, lead[0], q_len, k_len)]  # (a tie: said per row)
    return [keep.reshape((1,) * max(0, 4 - keep.dim()) + tuple(keep.shape[-min(keep.dim(), 4):]))]


def _either_way(name: str, mask: np.ndarray, kernel: np.ndarray, q_len: int, k_len: int) -> dict | None:
    """dropped()'s answer for a bool mask (B|1, H|1, Lq|1, Lk), whose polarity its frame does not say: read as True =
    keep and as True = masked, a cell lost where the kernel sees it on a row the reading leaves some key; said only
    where both readings lose cells (the kernel keeps to neither), the reading that loses fewer. A key mask's padding
    queries (their own key, placed bottom-right, masked) are not counted, nor a square mask's (their own key seen by
    no query of the row): where padding queries look is the pad's business (a causal kernel over right padding sees no
    padding key from a real query: OpenNMT#2464's fix runs its decoder is_causal beside a padded dec_mask)."""
    try:
        planes = np.broadcast_shapes(mask.shape, kernel.shape)
    except ValueError:
        return None
    if mask.all() or not mask.any():
        return None
    seen = np.broadcast_to(kernel, planes)
    best, rank = None, None
    for keep in (mask, ~mask):
        given = np.broadcast_to(keep, planes)
        counted = given.any(axis=-1, keepdims=True)
        own = None
        if q_len <= k_len:  # (each query's own key, placed bottom-right: kept where the reading calls the query real)
            at = np.arange(q_len)
            own = keep[:, :, 0, k_len - q_len:] if mask.shape[2] == 1 else keep[:, :, at, k_len - q_len + at]
        if own is not None and mask.shape[2] == 1:
            counted = counted & own[..., None]  # (a key mask's padding queries: not judged)
        elif own is not None and q_len == k_len:  # (a square mask's padding queries: those whose own key no query of
            counted = counted & keep.any(axis=2)[..., None]  # the row sees, OpenNMT's dec_mask over target padding)
        lost = seen & ~given & counted
        if not lost.any():
            return None  # (the kernel keeps to this reading)
        # (said in the likelier reading: the one that keeps more queries' own keys, then the one that loses fewer cells)
        this = (-(int(own.sum()) if own is not None else 0), int(lost.sum()))
        if rank is None or this < rank:
            best, rank = {"name": name, "cell": [int(x) for x in np.argwhere(lost)[0]], "cells": int(lost.sum()),
                          "masked": int((~given & counted).sum()), "one_row": one_row(given, seen)}, this
    return best


def one_row(given: np.ndarray, seen: np.ndarray) -> int | None:
    """The batch row r of the handed mask (B, H, Lq, Lk, broadcast) whose cells the kernel applies to every batch row,
    where the handed rows differ: one sample's mask taken for the whole batch (octo-pytorch 3380db5's
    `attention_mask[0, 0]`); None where no one row is it, or where the kernel masks nothing: a row the mask leaves
    whole is then no row the kernel took but none at all (CoLT5-attention 0f34926's `self.attend(q, k, v)`)."""
    if given.shape[0] < 2 or (given == given[:1]).all() or seen.all():
        return None
    for r in range(given.shape[0]):
        if (r == 0 or not (given[r] == given[:r]).all(axis=(1, 2, 3)).any()) and (seen == given[r][None]).all():
            return r
    return None
