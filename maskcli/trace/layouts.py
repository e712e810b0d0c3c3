"""Scores laid out in another axis order than (B, H, Lq, Lk), where the product that made them says which axis is which.

Transformer-XL's and XLNet's `einsum("ibnd,jbnd->ijbn", q, k)` gives (Lq, Lk, B, H) and softmaxes over dim 1; a port may write
"bqhd,bkhd->bqhk" and softmax over the last dim of (B, Lq, H, Lk). The einsum's equation states the layout: the output
axes that both operands hold are the batch and head axes, the one only the first operand holds is one side of the
product and the one only the second holds the other. A softmax over one of those two is attention over it (its keys),
read as the usual (B, H, Lq, Lk) scores through a permuted view of the same tensor (no copy). Scores from q @ kᵀ
(matmul, bmm, or an einsum ending in the query and key axes) that the program permutes or transposes before the
softmax are followed the same way. Only scores scores.py saw made so are read here: a 4-D softmax over dim 1 is most
often a segmentation map's over its classes, no attention. An axis order is a permutation `axes` of the tensor's
dimensions: x.permute(axes) puts the shared axes first and the two sides of the product last; None: the plain order.
"""

from __future__ import annotations

import functools

import torch

TURNS = frozenset({torch.permute, torch.Tensor.permute, torch.transpose, torch.Tensor.transpose, torch.swapaxes,
                   torch.Tensor.swapaxes, torch.swapdims, torch.Tensor.swapdims, torch.movedim, torch.Tensor.movedim})
NONE = object()  # (carried(): `out` is no scores)


@functools.lru_cache(maxsize=256)
def einsum_axes(equation, rank: int) -> tuple[int, ...] | None:
    """The axis order of a two-operand einsum's output: the axes both operands hold (in output order), then the one only
    the first holds, then the one only the second holds; None where the output has not exactly one axis of each
    operand alone ("blhd,blhdj->blhj", Longformer's band of keys gathered per position, has none of the first's alone),
    or where the equation is not one of two operands with an explicit output. An ellipsis stands for shared axes."""
    if not isinstance(equation, str) or "->" not in equation:
        return None
    given, out = equation.replace(" ", "").split("->")
    parts = given.split(",")
    if len(parts) != 2 or out.count("...") > 1:
        return None
    extra = rank - len(out.replace("...", ""))
    letters = out.replace("...", "." * max(extra, 0))
    if len(letters) != rank:
        return None
    shared, first, second = [], [], []
    for axis, letter in enumerate(letters):
        if letter == ".":
            shared.append(axis)
            continue
        ours, theirs = letter in parts[0], letter in parts[1]
        (shared if ours and theirs else first if ours else second).append(axis)
    if len(first) != 1 or len(second) != 1:
        return None
    return (*shared, first[0], second[0])


def carried(func, args: tuple, kwargs: dict, x: torch.Tensor, out: torch.Tensor, axes):
    """The axis order of `out`, computed by `func` from scores `x` laid out as `axes` (None: plain): None where `out` is
    plain scores, a permutation, or NONE where `out` is no scores maskcli can still read (a reshape of laid-out ones)."""
    if func in TURNS and args and args[0] is x:
        turn = _turn(func, args, kwargs, x.dim())
        if turn is None or out.dim() != x.dim():
            return NONE
        where = {given: axis for axis, given in enumerate(turn)}  # x's axis -> its place in out
        new = tuple(where[axis] for axis in (axes or range(x.dim())))
        return None if new == tuple(range(len(new))) else new
    if axes is None:  # (plain scores: what keeps their last two dimensions is scores, scores.py)
        return None if tuple(x.shape[-2:]) == tuple(out.shape[-2:]) else NONE
    if out.dim() == x.dim() and all(a == b or a == 1 for a, b in zip(x.shape, out.shape)):
        return axes  # (elementwise: a scaling, an added bias, masked_fill, a cast)
    return NONE


def _turn(func, args: tuple, kwargs: dict, rank: int) -> tuple[int, ...] | None:
    """out's dimensions as x's: out axis i is x axis turn[i]; None where the arguments are not read."""
    rest = list(args[1:])
    try:
        if func in (torch.permute, torch.Tensor.permute):
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest or kwargs.get("dims")
            turn = tuple(int(d) % rank for d in dims)
            return turn if sorted(turn) == list(range(rank)) else None
        if func in (torch.movedim, torch.Tensor.movedim):
            source, destination = (rest + [kwargs.get("source"), kwargs.get("destination")])[:2]
            source = [source] if isinstance(source, int) else list(source)
            destination = [destination] if isinstance(destination, int) else list(destination)
            placed = {int(d) % rank: int(s) % rank for s, d in zip(source, destination)}
            left = iter(a for a in range(rank) if a not in placed.values())
            return tuple(placed[i] if i in placed else next(left) for i in range(rank))
        names = ("dim0", "dim1") if func in (torch.transpose, torch.Tensor.transpose) else ("axis0", "axis1") \
            if func in (torch.swapaxes, torch.Tensor.swapaxes) else ("dim0", "dim1")
        a, b = (rest + [kwargs.get(names[0]), kwargs.get(names[1])])[:2]
        a, b = int(a) % rank, int(b) % rank
    except (TypeError, ValueError, IndexError, KeyError, StopIteration):
        return None
    turn = list(range(rank))
    turn[a], turn[b] = b, a
    return tuple(turn)


def reader(softmax, scores, args: tuple, kwargs: dict):
    """The reader of a softmax over scores laid out in another axis order (`softmax`, masks.softmax, where they are
    plain): over one side of the product, that softmax read through the permuted view (its keys: the softmax's axis);
    over any other axis, no attention call (None)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    axes = scores.axes_of(x)
    if axes is None:
        return softmax
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(dim, int):
        return _nothing
    dim %= x.dim()
    if dim == axes[-2]:  # (over the first operand's side: those are the keys it attends over)
        axes = (*axes[:-2], axes[-1], axes[-2])
    elif dim != axes[-1]:
        return _nothing

    def laid(args_, kwargs_):
        seen = softmax((x.permute(axes), -1), {})
        if seen is not None:
            seen.details["axes"] = list(axes)  # (the program's scores are this permutation of (B, H, Lq, Lk)'s)
        return seen

    laid.api = "softmax"
    return laid


def _nothing(args: tuple, kwargs: dict):
    return None


_nothing.api = "softmax"


def heads_first(softmax, scores, args: tuple, kwargs: dict, heads):
    """The reader of a softmax over the last axis of 4-D scores a q @ kᵀ made (`scores.has`) in no other stated order,
    whose first axis is the head count its module holds (`heads()`: scores.stated_heads of the modules running, read
    as the call is recorded) and whose second is not: laid out (H, B, Lq, Lk) (icefall's Zipformer and conformer
    attention permute q to (H, B, T, D) and mask with a (B, 1, T) key padding broadcast over the heads), read through
    the view with the first two axes swapped (details["axes"]); as `softmax` reads it elsewhere. Read as (B, H), each
    "batch row" held every sample, and one sample's padding was read against another's rows."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or dim not in (-1, 3) or not scores.has(x) \
            or scores.axes_of(x) is not None:
        return softmax

    def turned(args_, kwargs_):
        count = heads()
        if count is None or int(x.shape[0]) != count or int(x.shape[1]) in (1, count):
            return softmax(args_, kwargs_)
        seen = softmax((x.permute(1, 0, 2, 3), -1), {})
        if seen is not None:
            seen.details["axes"] = [1, 0, 2, 3]
        return seen

    turned.api = "softmax"
    return turned


def query_by_key(equation) -> bool:
    """An einsum whose output ends in a query index of one operand and a key index of the other (q @ kᵀ:
    "bhqd,bhkd->bhqk"); not one whose last two output indexes an operand shares (a band of keys gathered per position,
    "blhd,blhdj->blhj": its "queries" are the heads). An equation not read as such is taken as q @ kᵀ."""
    if not isinstance(equation, str) or "->" not in equation:
        return True
    given, out = equation.replace(" ", "").replace("...", "").split("->")
    parts = given.split(",")
    if len(out) < 2 or len(parts) != 2:
        return True
    query, key = out[-2], out[-1]  # (scores laid out otherwise, Transformer-XL's "ibnd,jbnd->ijbn": layouts.py)
    return (query in parts[0]) != (query in parts[1]) and (key in parts[0]) != (key in parts[1])
