"""A mask the program wrote into its scores with a fill that masks nothing: `torch.where(mask, score, 1e-9)`.

The program states which score cells it means to mask where it replaces them before the softmax (`torch.where(keep,
scores, fill)`, `scores.masked_fill(pad, fill)`); a fill of about zero (|fill| <= 1: `+1e-9` for `-1e9`, a `0` for
`-inf`) is a score like any other, so the softmax gives those cells ordinary weight and the mask masks nothing
(awslabs/gluonts#1401: the TFT's causal and observed-value masks filled with +1e-9). Recorded on the scores (Scores.weak,
carried through their scaling) as (fill, the cells it replaced), and at the softmax as details["weak_fill"] where the
softmax sees some of those cells (checks/weakfill.py). Read only where the mask is no function of the scores' own
values: it broadcasts to them (a size-1 or stride-0 axis: a causal triangle, a key padding row), and the cells it
replaced held finite scores (a clamp, `torch.where(torch.isnan(s), 0, s)`, is neither).
"""

from __future__ import annotations

import torch

from maskcli.trace.undone import near_real

WHERES = {torch.where, torch.Tensor.where, torch.Tensor.masked_fill, torch.Tensor.masked_fill_}
MOST = 1 << 22  # score cells read at most
WEAK = 1.0  # a fill at most this far from 0 masks nothing beside ordinary scores


def _constant(value) -> float | None:
    """The one value `value` holds (a number, a 0-dim tensor, a tensor of one value throughout), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and 0 < value.numel() <= MOST:
        first = value.reshape(-1)[0]
        if bool((value == first).all()):
            return float(first)
    return None


def _broadcast(mask: torch.Tensor, shape: tuple) -> bool:
    """`mask` is bool and smaller than the scores it masks: some axis of it is 1 (or stride 0) where theirs is not."""
    if mask.dtype != torch.bool or mask.dim() > len(shape):
        return False
    sizes = (1,) * (len(shape) - mask.dim()) + tuple(mask.shape)
    strides = (0,) * (len(shape) - mask.dim()) + tuple(mask.stride())
    return any(n > 1 and (m == 1 or s == 0) for n, m, s in zip(shape, sizes, strides))


def replaced(func, args: tuple, kwargs: dict, out: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor] | None:
    """(the scores, fill, bool cells of `out` it replaced) where `func` wrote a fill of about zero into scores, else None."""
    if func not in WHERES or out.numel() > MOST:
        return None
    if func in (torch.where, torch.Tensor.where):
        parts = list(args) + [kwargs[n] for n in ("condition", "input", "other") if n in kwargs]
        if len(parts) != 3 or not isinstance(parts[0], torch.Tensor):
            return None
        mask, a, b = parts
        kept, other = _constant(a), _constant(b)
        if other is not None and kept is None and isinstance(a, torch.Tensor):
            x, fill, cells = a, other, ~mask
        elif kept is not None and other is None and isinstance(b, torch.Tensor):
            x, fill, cells = b, kept, mask
        else:
            return None
    else:
        x = args[0]
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        fill = _constant(args[2] if len(args) > 2 else kwargs.get("value"))
        cells = mask
        if not isinstance(mask, torch.Tensor):
            return None
    if fill is None or abs(fill) > WEAK or x.shape != out.shape or not x.is_floating_point() \
            or not _broadcast(mask, tuple(x.shape)):
        return None
    with torch.no_grad():
        cells = cells.broadcast_to(x.shape)
        if not cells.any() or not bool(torch.isfinite(x.detach()[cells]).all()):
            return None
        return x, fill, cells.clone()


def carry(weak: dict, has, func, args: tuple, kwargs: dict, x: torch.Tensor, out: torch.Tensor) -> None:
    """Note on `out` (computed from scores `x`, their shape kept) the weak fill `x` carries, or one `func` wrote into
    scores (`has`: whether a tensor is scores)."""
    wrote = replaced(func, args, kwargs, out) if func in WHERES else None
    if wrote is not None and not has(wrote[0]):
        wrote = None
    if wrote is not None:
        x = wrote[0]
    before = weak.get(id(x))
    if wrote is None:
        if before is not None and before[1].shape == out.shape:
            weak[id(out)] = before
        return
    _, fill, cells = wrote
    if before is not None and before[1].shape == out.shape:
        cells = cells | before[1]
    weak[id(out)] = (fill, cells)


def weak_filled(weak: dict, has, x, call, seen) -> None:
    """At softmax `call` over scores `x`: details["weak_fill"] where cells a weak fill replaced are seen by the softmax."""
    held = weak.get(id(x)) if isinstance(x, torch.Tensor) and has(x) else None
    if held is None or "axes" in seen.details:
        return
    keep = seen.keep if seen.keep is not None else seen.materialize()
    if keep is None:
        return
    fill, cells, undone = (*held, None)[:3]
    if undone is not None and cells.shape == x.shape:  # (a fill lifted back: only the cells it left ordinary, and
        cells = near_real(x, cells)  # the value they hold at the softmax, after any scaling)
        fill = float(x.detach()[cells][0]) if bool(cells.any()) else fill
    with torch.no_grad():
        try:
            cells = cells.reshape(keep.shape) if cells.numel() == keep.numel() else cells
            seen_cells = cells & keep
        except RuntimeError:
            return
        count = int(seen_cells.sum())
        if not count:
            return
        first = tuple(int(i) for i in seen_cells.nonzero()[0])
    call.details["weak_fill"] = seen.details["weak_fill"] = {"value": fill, "cells": count, "cell": list(first),
                                                             **({"undone": undone} if undone else {})}
