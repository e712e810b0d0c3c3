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
                if pool is not None and not attended(trace, pool, args, kwargs):  # (additive attention: a call)
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


def attended(trace, pool: Pool, args: tuple, kwargs: dict) -> bool:
    """Record additive attention as a call: a pooling whose weights are one query a batch row over positions a padding
    the program's frames hold lies over (Bahdanau's and ESPnet's location-aware attention: scores from a tanh MLP, no
    q @ kᵀ, a softmax over the encoder's frames, then `sum(enc_h * w.view(B, T, 1), dim=1)`), in a model call that has
    made no attention call but such ones. The call is (B, 1, 1, T), its mask the positions given a weight above
    WEIGHED; its pooling is kept with it (checks/pooledpad.py judges it). Whether it was recorded."""
    held = trace._local.outer
    calls = getattr(trace, "_calls", ())
    if held is not None and len(calls) > held[5] and "additive_pool" not in calls[-1].details:
        return False  # (a model call that attends by q @ kᵀ: its poolings are heads over its output, kept as before;
        # its latest call says so, since no additive call is recorded after another kind in one model call)
    weights = pool.weights
    moved = weights.movedim(pool.axis, -1)
    rows, length = int(moved.shape[0]), int(moved.shape[-1])
    if moved.numel() != rows * length or length < 2:
        return False  # (several queries a row: attention's own rows, read by the softmax reader where it is one)
    from maskcli.trace.held import padding

    trace.busy = True
    try:
        said = padding()
    except (Exception, SystemExit):  # noqa: BLE001 - a frame that cannot be read states nothing
        said = None
    finally:
        trace.busy = False
    if not any(one["kind"] in ("keep", "pad", "lengths") and len(one["rows"]) == rows for one in said or ()):
        return False  # (no padding over its rows: a pooling no mask could change, kept as a pooling)
    trace.capture(_additive_reader(weights, pool), args, kwargs)
    pool.keep(trace)
    return True


def _additive_reader(weights: torch.Tensor, pool: Pool):
    from maskcli.trace.masks import Seen, _dtype

    def read(args: tuple, kwargs: dict):
        with torch._C.DisableTorchFunction(), torch.no_grad():
            moved = weights.detach().movedim(pool.axis, -1)
            keep = (moved.reshape(moved.shape[0], 1, 1, moved.shape[-1]) > WEIGHED).cpu()
        shape = tuple(int(n) for n in keep.shape)
        seen = Seen("softmax", shape, tuple(int(n) for n in weights.shape), (), (), _dtype(weights), str(weights.device),
                    details={"additive_pool": {"how": pool.how, "axis": pool.axis},
                             "cross": {"cross": True, "by": "scores", "source": "additive attention: one query a batch "
                                       "row weighing the positions of the values it pools"}})
        seen.keep = keep
        return seen

    read.api = "softmax"
    return read
