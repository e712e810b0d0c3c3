"""A softmax's weights that pool values over the softmax's own axis: attention pooling, recorded with where it weighs.

Attention pooling (a classification head's `softmax(weighting_layer(h), dim=1)`, then `sum(weights * h, dim=1)`;
`bmm(softmax(scores).unsqueeze(1), h)`; `einsum("bl,bld->bd")`) is one query per batch row over the positions: a softmax
of no attention (trace/pooled.py holds the last few of their results) whose very result weighs values that carry its
axis. The product states what the weights pool: the values along the softmax's axis, each scaled by its weight (a
product that also sums them is a matmul's or an einsum's over that axis; a product by values broadcast over an axis the
weights are 1 on is the weighting, which a sum completes). No attention call is recorded: the outermost module call
running keeps, in its Top's `pools`, the (rows, positions) each pooling gives a weight above WEIGHED, with its shape
and axis: checks/pooledpad.py compares them with the padding that call states. A product by a tensor of the weights'
own shape (a 0/1 mask zeroing pads, AllenNLP's masked_softmax) weighs no values: nothing is kept, and what is
renormalised after it is no softmax's.
"""

from __future__ import annotations

import torch

WEIGHED = 1e-6  # a weight at most this is a position left out (exp of a -1e4 fill is 0 in float32)
MOST = 16  # poolings kept per outermost module call


def weighs_or(trace, wanted):
    """entry.py's test of a mul for what follows it, `wanted`'s, after keeping the pooling where an operand is held
    weights or a view of them (read off the ids first: every mul a model runs passes here)."""

    def either(args: tuple, kwargs: dict, out) -> bool:
        if not trace._local.busy:  # (a rotary factor it multiplies by: trace/rotated.py)
            trace.rotations.note(args, out)
        pooled = trace._pooled
        if pooled is not None and pooled.held and len(args) == 2 and not trace._local.busy:
            held = pooled.held
            if any(type(x) is torch.Tensor and (id(x) in held or x._base is not None and id(x._base) in held)
                   for x in args):
                pool = weighting(pooled, args)
                if pool is not None:
                    pool.keep(trace)
        return wanted(args, kwargs, out)

    return either


def fills_or(trace, wanted):
    """entry.py's test of an out-of-place masked_fill, after holding its result where it fills held weights
    (pooled.py's `filled`)."""

    def either(args: tuple, kwargs: dict, out) -> bool:
        if not trace._local.busy:  # (a rotary factor it multiplies by: trace/rotated.py)
            trace.rotations.note(args, out)
        pooled = trace._pooled
        if pooled is not None and pooled.held and not trace._local.busy:
            pooled.filled(args, out)
        return wanted(args, kwargs, out)

    return either


def weighting(pooled, args: tuple):
    """The pooling where a product (a mul) weighs values by held weights broadcast over an axis the weights
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
            return Pool(weights, axis, "a product by values broadcast over their features")
        if values.shape == weights.shape and values is not weights and _valued(values):
            return Pool(weights, axis, "a product by values of their own shape (a weight per feature)")
    return None


def _valued(values: torch.Tensor) -> bool:
    """Floating values other than a 0/1 mask (AllenNLP's masked_softmax multiplies its weights by the mask: no
    pooling)."""
    if not values.is_floating_point():
        return False
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return bool(((values != 0) & (values != 1)).any())


def own_axis(weights: torch.Tensor, axis: int, how: str):
    """The pooling of a matmul or an einsum that sums the weights over their softmax's own axis (`axis`, not the
    batch's): None where the weights are one row of positions with no batch axis."""
    if axis == 0 or weights.shape[axis] < 2:
        return None
    return Pool(weights, axis, how)


class Pool:
    """One pooling: its weights (a softmax's result or a view of it), the axis they weigh, the product's words."""

    __slots__ = ("weights", "axis", "how")

    def __init__(self, weights: torch.Tensor, axis: int, how: str):
        self.weights, self.axis, self.how = weights, axis, how

    def keep(self, trace) -> None:
        """Kept with the outermost module call running now (its Top's `pools`): the (rows, positions) it weighs, each
        batch row's positions given a weight above WEIGHED by any of its queries (heads, slots)."""
        held = trace._local.outer
        if held is None or held[0] is None:  # (no model call running: a head called on its own, s3prl's expert over
            calls = getattr(trace, "_calls", None)  # an upstream's features; kept with the last attention call made)
            if not calls:
                return
            found = calls[-1].details.setdefault("loose_pools", [])
        else:
            found = trace._pools.setdefault(id(held), [])
        if len(found) >= MOST:
            return
        from maskcli.trace.held import padding

        trace.busy = True  # (its reads are maskcli's: no wrapper, nor the mode, takes them for the program's)
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                moved = self.weights.detach().movedim(self.axis, -1)
                rows, length = int(moved.shape[0]), int(moved.shape[-1])
                weighed = (moved.reshape(rows, -1, length) > WEIGHED).any(dim=1).cpu().numpy()
            try:  # (the padding the program's frames hold as it pools: a pooling's own lengths, s3prl's `features_len`)
                held = padding()
            except (Exception, SystemExit):  # noqa: BLE001 - a frame that cannot be read states nothing
                held = None
        finally:
            trace.busy = False
        found.append({"axis": self.axis, "shape": tuple(int(n) for n in self.weights.shape), "how": self.how,
                      "weighed": weighed, "held": held or ()})
