"""A mean over a batch's positions whose sum counts positions its divisor, a mask's sum, does not.

`x.sum(dim) / mask.sum(-1)` is a masked mean: the divisor counts each row's real positions (the 0/1 mask the program
holds), so the sum must run over those alone (`(x * mask).sum(dim)`, or x already 0 where the mask is). Every
`sum` over one axis is looked at as it runs (entry.py's REDUCE wrapper): a 2-D 0/1 integer or bool tensor with a 0
in it summed over its last axis is followed (weakly, until the next model call begins) as a count of positions,
through the calls that keep its elements (an unsqueeze, a clamp, a cast, `+ eps`); a float tensor of 2 dims or more
summed over one axis other than its first, its dims not kept, is remembered (the last few, weakly, with what it
summed). A division of such a sum by such a count, the sum's
first axis the mask's rows and its summed axis as long as the mask's positions, where the summed tensor is not 0 at
some position the mask leaves out of its row's count, is recorded on the last attention call made
(details `masked_mean`: checks/maskmean.py says it). rerankers#75: ColBERT's MaxSim summed over every query token,
the [MASK] augmentation's too, divided by `q_mask.sum()`. The terms may be divided first: a tensor (its first axis the
mask's rows) divided by such a count is followed, through a product by any tensor and the calls that keep its
elements, to its sum over an axis as long as the mask's positions (Uni-Mol#211: `delta_pos / atom_num * attn_probs`
summed over the atom pairs, the padded atoms' too). The mask may be float 0/1 (`1 - padding_mask.type_as(x)`).

The mirror: a `mean` over axis 1 of a (B, L, D) float tensor (a pooling over the positions) divides by all L. Where
some row of it is exactly 0 at some positions and not at others (the program zeroed them, `output * mask`), the
zeroed positions are recorded on the last attention call made (details `zero_mean`: checks/maskmean.py holds them to
the positions that call masks as padding). UER-py#190: `torch.mean(output * seg, dim=1)`, the padded length counted.
A mean over as many rows and positions as that call's self-attention with nothing zeroed is recorded there too: the
padding's own values averaged in (checks/maskmean.py's mean-over-padding; lobster#149's `embeddings.mean(dim=1)`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from maskcli.trace.unseen import unseen

MOST = 4096  # a count's mask elements at most
HELD = 8  # sums remembered at once
MOST_MEANED = 1 << 24  # a mean's elements at most, looked at for zeroed positions
MEANS = frozenset({torch.mean, torch.Tensor.mean})
REDUCES = frozenset({torch.sum, torch.Tensor.sum, *MEANS})
DIVISIONS = frozenset({"div", "divide", "true_divide", "__truediv__"})
PRODUCTS = frozenset({"mul", "multiply", "__mul__", "__rmul__"})  # (by name: a method reaches the mode as itself)


def reduced(args: tuple, kwargs: dict, out) -> bool:
    """A sum over one axis of a tensor of 2 dims or more (entry.py's wanted REDUCE; every sum passes here)."""
    return type(out) is torch.Tensor and len(args) > 0 and type(args[0]) is torch.Tensor and args[0].dim() >= 2 \
        and isinstance(_dim(args, kwargs), int)


def over_positions(args: tuple, kwargs: dict, out) -> bool:
    """A mean over axis 1 of a (B, L, D) float tensor (entry.py's wanted MEAN: every mean passes here, the norms' over
    the last axis too, so it asks little)."""
    if type(out) is not torch.Tensor or not args or type(args[0]) is not torch.Tensor or args[0].dim() != 3:
        return False
    dim = _dim(args, kwargs)
    return dim in (1, -2) and args[0].shape[1] > 1 and args[0].is_floating_point()


def _dim(args: tuple, kwargs: dict):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim


class MaskMean:
    def __init__(self) -> None:
        self._found: dict = {}  # id(a count) -> (weakref to it, the (B, L) bool mask it counts)
        self.sums: dict = {}  # id(a sum) -> (weakref to it, weakref to what it summed, the axis summed)

    def after(self, func, args: tuple, kwargs: dict, out, calls: list) -> None:
        """A sum remembered, a count followed through a call keeping its elements, a division looked at."""
        try:
            if func in MEANS:
                if over_positions(args, kwargs, out) and calls:
                    with unseen():
                        self._meaned(args[0], calls)
            elif func in REDUCES:
                if reduced(args, kwargs, out):
                    with unseen():
                        self._summed(args, kwargs, out, calls)
            elif len(args) > 1 and getattr(func, "__name__", "") in DIVISIONS:
                with unseen():
                    self._divided(args[0], args[1], out, calls)
            elif len(args) > 1 and getattr(func, "__name__", "") in PRODUCTS:
                self._weighed(args, out)
            else:
                self._kept(func, args, kwargs, out)
        except (Exception, SystemExit):  # noqa: BLE001 - what the other followers read of this call is read still
            pass

    def forget(self) -> None:
        """An outermost model call begins: the counts made before it are followed no longer. A masked mean divides by a
        count made after the model ran (its output pooled); a count held across calls (`lengths = mask.sum(1)` before
        a loop) would keep the mode on, every torch call of the program dispatched, for as long as it lived."""
        if self._found:
            self._found.clear()

    def _kept(self, func, args: tuple, kwargs: dict, out) -> None:
        """A count followed on through a call that keeps its elements (no other tensor in it; a view's sizes); `L -
        count` (`__rsub__` by the mask's length) on as the count of the positions the mask leaves out (multicenter-sepsis'
        `labels.shape[-1] - invalid_indices.sum(-1)`: the valid steps' count), another subtraction from it no more."""
        if args and id(args[0]) in self._found and type(out) is torch.Tensor \
                and (len(args) + len(kwargs) <= 3 or all(type(a) is int for a in args[1:])) \
                and not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
            held = self._found[id(args[0])]
            if held[0]() is not args[0] or out.numel() != args[0].numel():
                return
            name = getattr(func, "__name__", "")
            if name in ("__rsub__", "rsub") and len(held) == 2:
                if len(args) > 1 and args[1] == held[1].shape[1]:
                    self._follow(out, ~held[1])
                return
            if name not in ("neg", "__neg__", "negative"):
                self._follow(out, *held[1:])

    def _follow(self, count: torch.Tensor, mask: np.ndarray, *divided) -> None:
        """`divided`: ("divided",) where `count` is values divided by a count (a mean's terms before their sum)."""
        key = id(count)
        self._found[key] = (weakref.ref(count, lambda _, key=key, found=self._found: found.pop(key, None)), mask,
                            *divided)

    def _weighed(self, args: tuple, out) -> None:
        """Terms divided by a count, weighed by another tensor (Uni-Mol's `delta_pos / atom_num * attn_probs`): still
        a mean's terms over the count's positions."""
        for given in args[:2]:
            held = self._found.get(id(given)) if type(given) is torch.Tensor else None
            if held is not None and len(held) > 2 and held[0]() is given and type(out) is torch.Tensor \
                    and out.dim() >= 2 and out.shape[0] == held[1].shape[0]:
                self._follow(out, held[1], "divided")
                return

    def _summed(self, args: tuple, kwargs: dict, out, calls: list) -> None:
        x, dim = args[0], _dim(args, kwargs)
        if not -x.dim() <= dim < x.dim() or x.device.type == "meta":
            return
        dim %= x.dim()
        if x.dim() == 2 and dim == 1 and x.numel() <= MOST and not x.is_complex():
            values = x.detach().cpu().numpy()  # (a float 0/1 mask too: Uni-Mol counts `1 - padding_mask.type_as(x)`)
            if ((values == 0) | (values == 1)).all() and (values == 0).any() and (values == 1).any():
                self._follow(out, values != 0)
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        held = self._found.get(id(x))
        if held is not None and len(held) > 2 and held[0]() is x and dim != 0 and x.shape[dim] == held[1].shape[1]:
            self._check(x, held[1], dim, calls, "each term divided before the sum")
        if x.is_floating_point() and dim != 0 and not keep:
            if len(self.sums) >= HELD:
                self.sums.pop(next(iter(self.sums)))
            self.sums[id(out)] = (weakref.ref(out), weakref.ref(x), dim)

    def _meaned(self, x: torch.Tensor, calls: list) -> None:
        """A mean over the positions of a (B, L, D) tensor some row of which is exactly 0 at some positions and not at
        others: those positions, on the last attention call."""
        if x.device.type == "meta" or x.numel() > MOST_MEANED:
            return
        zero = (x.detach() == 0).all(dim=-1).cpu().numpy()
        if (zero.any(axis=1) & ~zero.all(axis=1)).any():
            calls[-1].details.setdefault("zero_mean", []).append({"zeroed": zero, "shape": list(x.shape)})
        elif not zero.any() and calls[-1].shape[0] == x.shape[0] and calls[-1].shape[2] == calls[-1].shape[3] == x.shape[1] \
                and len(calls[-1].details.get("zero_mean") or ()) < 4:  # (nothing zeroed, over a self-attention's
            calls[-1].details.setdefault("zero_mean", []).append({"zeroed": zero, "shape": list(x.shape)})  # positions)

    def _divided(self, num, den, out, calls: list) -> None:
        count, summed = self._found.get(id(den)), self.sums.get(id(num))
        if count is None or len(count) > 2 or count[0]() is not den:
            return
        if summed is None or summed[0]() is not num:  # (terms divided before their sum: followed to it)
            if type(num) is torch.Tensor and num.dim() >= 2 and num.shape[0] == count[1].shape[0] \
                    and type(out) is torch.Tensor and num.is_floating_point():
                self._follow(out, count[1], "divided")
            return
        x, mask, dim = summed[1](), count[1], summed[2]
        if x is None or x.shape[0] != mask.shape[0] or x.shape[dim] != mask.shape[1]:
            return
        self._check(x, mask, dim, calls)

    def _check(self, x: torch.Tensor, mask: np.ndarray, dim: int, calls: list, how: str = "") -> None:
        """Record, on the last attention call, a sum over `dim` of `x` whose values at positions `mask` leaves out of
        its count are not 0."""
        if not calls:
            return
        values = torch.movedim(x.detach(), dim, 1).reshape(x.shape[0], x.shape[dim], -1).cpu().numpy()
        counted = found_in(values, mask)
        if counted is not None:
            row, positions = counted
            calls[-1].details.setdefault("masked_mean", []).append({
                "row": row, "positions": positions, "mask": list(mask.shape), "summed": list(x.shape), "axis": dim,
                **({"how": how} if how else {})})


def found_in(values: np.ndarray, mask: np.ndarray) -> tuple[int, list[int]] | None:
    """(the first row, its positions) where (B, L, ...) `values` are not 0 at a position the (B, L) bool `mask` leaves
    out of a row it counts some position of; None where the sum runs over the counted positions alone."""
    for row in range(mask.shape[0]):
        if not mask[row].any():
            continue
        out = ~mask[row] & (values[row] != 0).any(axis=-1)
        if out.any():
            return row, np.flatnonzero(out).tolist()
    return None
