"""Tensors a trace follows by identity after a call made them (a softmax's weights, their product with the values),
and the operands of the products it reads them at (trace/after.py, trace/weights.py, trace/scores.py)."""

from __future__ import annotations

import weakref

import torch

KEEP = 64  # tensors followed at most in one table (more: all forgotten)


def operands_of(func, args: tuple) -> tuple:
    """The tensors a product multiplies: its arguments, or einsum's after its equation (a list of them too)."""
    operands = args[1:] if func is torch.einsum else args
    if func is torch.einsum and len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    return operands


def batched(x: torch.Tensor) -> bool:
    """A product's operand that holds a batch of its own, not one table shared by every row: false only of a tensor of
    more than one batch row whose every leading axis longer than one is a broadcast (stride 0), as Performer's random
    features are (`projection_matrix[None, None].expand(b, h, m, d)`: q @ featuresᵀ is no score of a query for a key).
    A batch of one says nothing (a grouped-query key expanded over its heads looks the same)."""
    lead = [stride for size, stride in zip(x.shape[:-2], x.stride()[:-2]) if size > 1]
    return x.dim() < 3 or x.shape[0] < 2 or any(lead) or not lead


def follow(found: dict, key, out: torch.Tensor, *entry) -> None:
    """Keep (a weak reference to `out`, *entry) under `key` in `found`, let go when `out` dies (every entry forgotten
    past KEEP of them)."""
    if len(found) >= KEEP:
        found.clear()

    def gone(ref) -> None:
        if found.get(key, (None,))[0] is ref:
            del found[key]

    try:
        found[key] = (weakref.ref(out, gone), *entry)
    except TypeError:
        pass
