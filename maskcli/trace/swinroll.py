"""How far a shifted-window block rolled its map before cutting windows, read at an attention call made under it.

A running module holding `shift_size` and `window_size` (or `win_size`: Swin's SwinTransformerBlock and its ports:
Pangu / FengWu's Transformer3DBlock, Uformer's, Video Swin's; an int or one per axis) rolls its (H, W) map (or Pangu's
(Pl, Lat, Lon) one, where it states three shifts) by that shift before cutting
it into windows, and its window mask is cut for that shift (checks/swinroll.py). The roll is read off the tensors the
block's own forward frame holds while its window attention runs: two 4-D tensors (5-D for three shifts) of one shape
of which one is the other rolled along two axes (three) (channels last or first) by one offset only, found by the first plane's values and
confirmed with torch.roll on the whole tensor; the roll of the one the frame holds later from the one it holds first
(the variables in the order the forward names them: the map, then the map rolled). The map is the one the block holds
now, of whatever size (a block built for one `input_resolution` run on another: checks/swin.py reads the size rolled);
where two readings are found, the one over `input_resolution`. A map rolled first and padded to whole windows after
is read too ("padded_after": its own size; timm's Swin V2, pytorch-image-models#2438). Nothing where no pair or more
than one offset is found (a map whose values repeat), nor where the block rolled in place (no pre-roll tensor held).
"""

from __future__ import annotations

import sys
from itertools import combinations

import torch

from maskcli.trace.held import program_frames

FRAMES = 6  # program frames searched for the block's forward
TENSORS = 8  # 4-D tensors of that frame compared, at most
CELLS = 1 << 22  # tensors compared up to this many elements
CANDIDATES = 16  # offsets tried per pair (the first plane's cells equal to the rolled plane's first)


WINDOWS = ("window_size", "win_size")  # (Uformer's LeWin block names its window `win_size`)


def _sizes(value, axes: int = 2) -> tuple[int, ...] | None:
    """`axes` ints of an int, or of a tuple or list of that many ints; None otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * axes
    if isinstance(value, (tuple, list)) and len(value) == axes \
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return tuple(int(x) for x in value)
    return None


def _pair(value) -> tuple[int, int] | None:
    """(a, b) of an int or of a pair of ints; None otherwise."""
    return _sizes(value)


def window_of(own: dict):
    """A module's window size as it states it (`window_size`, else `win_size`); None where it states none."""
    return next((own[name] for name in WINDOWS if own.get(name) is not None), None)


def block_roll(module) -> dict | None:
    """{"shift", "window", "roll", "map", "dims"} of a block stating a shift on every axis of its windows (2, or 3 as
    Pangu's (pressure level, latitude, longitude)) whose forward frame holds its map and the map rolled by one offset;
    None otherwise."""
    own = module.__dict__
    stated = own.get("shift_size")
    axes = len(stated) if isinstance(stated, (tuple, list)) and len(stated) == 3 else 2
    shift, window = _sizes(stated, axes), _sizes(window_of(own), axes)
    if shift is None or window is None or not all(0 < s < w for s, w in zip(shift, window)):
        return None
    frame = next((f for f in program_frames(sys._getframe(1), FRAMES) if f.f_locals.get("self") is module), None)
    if frame is None:
        return None
    tensors, seen = [], set()
    for value in frame.f_locals.values():
        if issubclass(type(value), torch.Tensor) and value.dim() == axes + 2 and 0 < value.numel() <= CELLS \
                and value.device.type != "meta" and id(value) not in seen:
            seen.add(id(value))
            tensors.append(value.detach())
    resolution = _sizes(tuple(own["input_resolution"])[-axes:], axes) \
        if isinstance(own.get("input_resolution"), (tuple, list)) and len(own["input_resolution"]) >= axes else None
    found = set()
    for first, second in combinations(tensors[:TENSORS], 2):  # (the frame's order: the map before the rolled one)
        if first.shape != second.shape or first.dtype != second.dtype:
            continue
        for dims in (tuple(range(1, axes + 1)), tuple(range(2, axes + 2))):  # (channels last, or first)
            size = tuple(first.shape[d] for d in dims)
            if any(n % w for n, w in zip(size, window)):
                continue
            offset = _offset(first, second, dims)
            if offset is not None:
                found.add((dims, offset, size))
    if len(found) > 1 and resolution is not None:  # (two readings: the one over the block's input_resolution)
        found = {one for one in found if one[2] == resolution}
    if not found and axes == 2:  # (no pair of one shape: the map rolled first and padded to whole windows after?)
        return _padded_after(tensors[:TENSORS], shift, window)
    if len(found) != 1:
        return None
    dims, offset, size = found.pop()
    return {"shift": shift, "window": window, "roll": offset, "map": size, "dims": dims}


def _padded_after(tensors: list, shift: tuple, window: tuple) -> dict | None:
    """The roll of a block that rolled its (H, W) map and then padded it with zeros to whole windows (timm's Swin V2
    `_attn`: torch.roll, then F.pad; pytorch-image-models#2438): a later 4-D tensor whose top-left (H, W) corner is an
    earlier one rolled by one offset and whose cells past it are 0, its sides whole windows. "padded_after": the map's
    own size, before the padding (checks/swin.py cuts the regions on it). None where no one such pair is found."""
    found = set()
    for first, second in combinations(tensors, 2):
        if first.shape == second.shape or first.dim() != second.dim() or first.dtype != second.dtype:
            continue
        for dims in ((1, 2), (2, 3)):
            size, padded = tuple(first.shape[d] for d in dims), tuple(second.shape[d] for d in dims)
            others = [d for d in range(first.dim()) if d not in dims]
            if any(first.shape[d] != second.shape[d] for d in others) or any(p % w for p, w in zip(padded, window)) \
                    or not all(n <= p < n + w for n, p, w in zip(size, padded, window)):
                continue
            corner = second.narrow(dims[0], 0, size[0]).narrow(dims[1], 0, size[1])
            offset = _offset(first, corner, dims)
            if offset is not None and int(torch.count_nonzero(second)) == int(torch.count_nonzero(corner)):
                found.add((dims, offset, padded, size))
    if len(found) != 1:
        return None
    dims, offset, padded, size = found.pop()
    return {"shift": shift, "window": window, "roll": offset, "map": padded, "dims": dims, "padded_after": size}


def _offset(first: torch.Tensor, second: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The one nonzero offset (one per axis of `dims`, each modulo its axis) with second == torch.roll(first, offset,
    dims); None where none or more than one is."""
    size = tuple(first.shape[d] for d in dims)
    ends = tuple(range(-len(dims), 0))
    plane = first.movedim(dims, ends).reshape(-1, *size)[0]
    corner = second.movedim(dims, ends).reshape(-1, *size)[0].reshape(-1)[0]
    spots = torch.nonzero(plane == corner)[:CANDIDATES + 1].tolist()
    if not spots or len(spots) > CANDIDATES:
        return None
    matches = []
    for spot in spots:
        offset = tuple((-i) % n for i, n in zip(spot, size))
        if torch.equal(torch.roll(first, offset, dims), second):
            matches.append(offset)
    return matches[0] if len(matches) == 1 and any(matches[0]) else None
