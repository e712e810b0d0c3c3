"""Tokens reordered within each batch row by a gather: the permutation, kept with the outermost module call (permuted.py).

A set or point-cloud encoder sorts its tokens before attention (hepattn's Encoder: `argsort(x_sort_value)`, then
`gather(x, -2, idx.unsqueeze(-1).expand_as(x))`, undone after); the padding mask the call was handed lines up with the
tokens as they were, so it must be gathered by the same index (hepattn c85cf35: it was not). The gather states the
permutation: a `torch.gather` / `Tensor.gather` along axis 1 of a (B, L, ...) tensor whose index is one position per
(row, token), broadcast over the trailing axes, each row a permutation of 0 .. L-1 and some row not in order. Kept,
with the number of attention calls recorded before it and the (B, L) 0/1 tensors that call was handed (its padding
as the tokens came in), by the frame of the outermost module call running (read only
where a gather is such a permutation: the call may have made no attention call yet), for that call's Top (`permuted`),
which
checks/permuted.py reads against the mask each later attention call ran with. Cheap: shapes first; a row's values
are read only for a gather of that form, at most MOST per call.
"""

from __future__ import annotations

import sys

import torch

from maskcli.trace.routed import subset, whole

GATHERS = frozenset({torch.gather, torch.Tensor.gather})
MOST = 8  # permutations kept per outermost module call
CELLS = 1 << 16  # (B, L) positions of an index read at most


def noted(trace):
    """entry.py's test of a gather: keeps the permutation it applies (where it is one), never lets the call through
    to an `after` (nothing else follows a gather)."""

    def note(args: tuple, kwargs: dict, out) -> bool:
        if trace._local.busy:
            return False
        found = permutation(args, kwargs)
        routed = subset(args, kwargs) if found is None else None  # (k of the L tokens taken: trace/routed.py)
        if found is not None or routed is not None:
            from maskcli.trace.sites import running

            calls = running(sys._getframe(1))  # (the outermost module call running: its frame, as Outer._called's)
            if calls:
                if len(trace._permuted) >= MOST and id(calls[-1][1]) not in trace._permuted:  # (calls that made no
                    trace._permuted.pop(next(iter(trace._permuted)))  # attention call: no Top took theirs)
                kept = trace._permuted.setdefault(id(calls[-1][1]), [])
                if len(kept) < MOST and routed is not None:
                    kept.append({"after": len(trace._calls), "positions": routed[0], "length": routed[1]})
                elif len(kept) < MOST:
                    kept.append({"after": len(trace._calls), "rows": found, "masks": _handed(calls[-1], found.shape)})
        return False

    return note


def _handed(call: tuple, shape: tuple) -> dict:
    """name -> bool (B, L) numpy of each 0/1 tensor of the permutation's shape the outermost module call was handed
    (its padding as the tokens came in: the call's own arguments, which its forward may rebind but not change)."""
    module, _, variables = call
    given = dict(variables.get("kwargs") or {})
    args = variables.get("args") or ()
    if args:
        import inspect

        try:
            given.update(inspect.signature(module.forward).bind_partial(*args).arguments)
        except (TypeError, ValueError):
            pass
    found = {}
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for name, value in given.items():
            if type(value) is torch.Tensor and tuple(value.shape) == shape and not value.is_floating_point() \
                    and bool(((value == 0) | (value == 1)).all()):
                found[name] = value.cpu().numpy().astype(bool)
    return found


def permutation(args: tuple, kwargs: dict):
    """The (B, L) int64 numpy permutation a gather applies along axis 1 of its input, or None."""
    given = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if type(given) is not torch.Tensor or type(index) is not torch.Tensor or not isinstance(dim, int):
        return None
    if given.dim() < 3 or index.dim() != given.dim() or dim % given.dim() != 1 or index.shape[:2] != given.shape[:2]:
        return None
    rows, length = int(index.shape[0]), int(index.shape[1])
    if length < 2 or rows * length > CELLS or index.dtype not in (torch.int64, torch.int32):
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        first = whole(index, rows, length)
        if first is None:
            return None  # (each feature gathered from its own position: no token moved whole)
        order = torch.arange(length, device=first.device)
        if not bool((first.sort(dim=1).values == order).all()) or bool((first == order).all()):
            return None
        return first.cpu().numpy().astype("int64")
