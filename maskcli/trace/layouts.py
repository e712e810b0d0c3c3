"""Attention scores laid out other than (..., Lq, Lk): read as the softmax over their (B, H, Lq, Lk) view.

Transformer-XL's and XLNet's original code einsum their scores as (Lq, Lk, B, H) ('ibnd,jbnd->ijbn') and softmax them
over dim 1. follow.py hands such a softmax to ijbn_softmax only where scores.py saw that tensor made from q @ kᵀ: a
4-D softmax over dim 1 is otherwise most often a segmentation map's over its classes, no attention.
"""

from __future__ import annotations

import torch

from maskcli.trace.masks import Seen, softmax, softmax_input


def over_keys_at_1(args: tuple, kwargs: dict) -> bool:
    """A softmax over dim 1 of a 4-D tensor (the (Lq, Lk, B, H) layout, where that tensor is scores)."""
    x = softmax_input(args, kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(x, torch.Tensor) and x.dim() == 4 and dim == 1


def ijbn_softmax(args: tuple, kwargs: dict) -> Seen | None:
    """The softmax over dim 1 of (Lq, Lk, B, H) scores, read as `softmax` reads their (B, H, Lq, Lk) view."""
    seen = softmax((softmax_input(args, kwargs).permute(2, 3, 0, 1), -1), {})
    if seen is not None:
        seen.details["layout"] = "ijbn"
    return seen


ijbn_softmax.api = "softmax"
