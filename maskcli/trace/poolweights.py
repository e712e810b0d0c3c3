"""A softmax's weights that pool values over the softmax's own axis: attention pooling, recorded with where it weighs.

Attention pooling (a classification head's `softmax(weighting_layer(h), dim=1)`, then `sum(weights * h, dim=1)`;
`bmm(softmax(scores).unsqueeze(1), h)`; `einsum("bl,bld->bd")`) is one query per batch row over the positions: a softmax
of no attention (trace/pooled.py holds the last few of their results) whose very result weighs values that carry its
axis. The product states what the weights pool: the values along the softmax's axis, each scaled by its weight (a
product that also sums them is a matmul's or an einsum's over that axis; a product by values broadcast over an axis the
weights are 1 on is the weighting, which a sum completes). Recorded as one call (batch, 1, 1, positions) whose mask
keeps the positions given a weight above WEIGHED, `details["pooled_weights"]` saying how: checks/pooledpad.py compares
it with the padding the model call states. A product by a tensor of the weights' own shape (a 0/1 mask zeroing pads,
AllenNLP's masked_softmax) weighs no values: nothing is recorded, and what is renormalised after it is no softmax's.
"""

from __future__ import annotations

import torch

from maskcli.trace.masks import Seen, _dtype

WEIGHED = 1e-6  # a weight at most this is a position left out (exp of a -1e4 fill is 0 in float32)


def weighs_or(trace, wanted):
    """entry.py's test of a mul for what follows it: `wanted`'s, or an operand that is held weights or a view of them
    (read off the ids alone: every mul a model runs passes here)."""

    def either(args: tuple, kwargs: dict, out) -> bool:
        pooled = trace._pooled
        if pooled is not None and pooled.held and len(args) == 2:
            held = pooled.held
            for x in args:
                if type(x) is torch.Tensor and (id(x) in held or x._base is not None and id(x._base) in held):
                    return True
        return wanted(args, kwargs, out)

    return either


def weighting(pooled, args: tuple):
    """A reader of the pooling where a product (a mul) weighs values by held weights broadcast over an axis the weights
    are 1 on, the values as long as the weights along the softmax's axis; else None."""
    operands = [x for x in args[:2] if isinstance(x, torch.Tensor)]
    if len(operands) != 2:
        return None
    for weights, values in (operands, operands[::-1]):
        axis = pooled._axis(weights)
        if axis is None or axis == 0 or weights.dim() < 2 or weights.shape[axis] < 2:
            continue
        if values.dim() != weights.dim() or values.shape[axis] != weights.shape[axis]:
            continue
        if any(w == 1 and v > 1 for w, v in zip(weights.shape, values.shape)):  # (features the weights broadcast over)
            return reader(weights, axis, "a product by values broadcast over their features")
    return None


def own_axis(weights: torch.Tensor, axis: int, how: str):
    """The reader of a matmul's or an einsum's pooling that sums the weights over their softmax's own axis (`axis`, not
    the batch's): None where the weights are one row of positions with no batch axis."""
    if axis == 0 or weights.shape[axis] < 2:
        return None
    return reader(weights, axis, how)


def reader(weights: torch.Tensor, axis: int, how: str):
    """A reader making the Seen of one pooling: (batch, 1, 1, positions), keeping each batch row's positions given a
    weight above WEIGHED by any of its queries (heads, slots)."""
    moved = weights.detach().movedim(axis, -1)
    rows, length = int(moved.shape[0]), int(moved.shape[-1])
    weighed = (moved.reshape(rows, -1, length) > WEIGHED).any(dim=1)  # (rows, length)
    shape = (rows, 1, 1, length)
    pooled = {"axis": axis, "shape": tuple(int(n) for n in weights.shape), "how": how}

    def read(args: tuple, kwargs: dict) -> Seen:
        seen = Seen("softmax", shape, tuple(int(n) for n in weights.shape), (), (), _dtype(weights),
                    str(weights.device), details={"pooled_weights": pooled})
        seen.keep = weighed.reshape(shape)
        return seen

    read.api = "softmax"
    return read
