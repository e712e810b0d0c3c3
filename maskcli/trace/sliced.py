"""Keys the kernel was handed as the tail of a longer key tensor (checks/slicedkeys.py).

A layer that slices its cache's keys to a mask's key axis (`k = k[:, :, -mask.shape[-1]:]`: mlxcel's Cohere2
attention) hands the kernel a view of the cache tensor: the keys before the slice are held, and not attended. Where the
kernel's (.., Lk, D) key tensor (or the (.., D, Lk) kᵀ of a hand-written q @ kᵀ) is a view of a base tensor with the same
strides and the same size on every axis but the key axis, its rows being the base's last Lk rows along that axis (a
tail: start > 0, ending where the base ends), the call records (start, base length) under "keys_sliced": its keys are
positions start .. base length - 1 of what the program holds. Read off the view's sizes, strides and storage offset;
nothing is copied, no torch function is called.
"""

from __future__ import annotations

import torch


def tail(key, turned: bool = False) -> tuple[int, int] | None:
    """(start, length) where `key` (.., Lk, D), or kᵀ (.., D, Lk) where `turned`, is a tail slice of its base along the
    key axis; None otherwise."""
    try:
        if not isinstance(key, torch.Tensor):
            return None
        base = key._base
        if base is None or base.dim() != key.dim() or key.dim() < 3 or not key.is_floating_point():
            return None
        shape, stride = list(key.shape), list(key.stride())
        if turned:  # (kᵀ: the key axis last; read as the keys it was turned from)
            shape[-1], shape[-2], stride[-1], stride[-2] = shape[-2], shape[-1], stride[-2], stride[-1]
        axis = key.dim() - 2
        length, n = int(base.shape[axis]), int(shape[axis])
        if n >= length or tuple(stride) != tuple(base.stride()) \
                or any(int(a) != int(b) for i, (a, b) in enumerate(zip(base.shape, shape)) if i != axis):
            return None
        start, left = divmod(int(key.storage_offset()) - int(base.storage_offset()), int(base.stride(axis)) or 1)
        if left or start + n != length or start <= 0:
            return None
        return start, length
    except (RuntimeError, NotImplementedError, AttributeError):  # (tensor subclasses: no view to read)
        return None


def note(details: dict, key, query=None) -> None:
    """details["keys_sliced"] = (start, length) where the kernel's `key` is a tail slice of its base and its `query` is
    not the same slice of its own (a packed batch's last request, `q[:, sl]`, `k[:, sl]`: its keys are that request's
    own, not a cache cut short)."""
    found = tail(key)
    if found is not None and (query is None or tail(query) != found):
        details["keys_sliced"] = found
