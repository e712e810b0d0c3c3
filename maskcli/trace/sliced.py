"""Keys the kernel was handed as the tail of a longer key tensor (checks/slicedkeys.py).

A layer that slices its cache's keys to a mask's key axis (`k = k[:, :, -mask.shape[-1]:]`: mlxcel's Cohere2
attention) hands the kernel a view of the cache tensor: the keys before the slice are held, and not attended. Where the
kernel's (.., Lk, D) key tensor is a view of a base tensor with the same dimensions and the same size on every axis but
the key axis, its rows being the base's last Lk rows along that axis (a tail: start > 0, ending where the base ends),
the call records (start, base length) under "keys_sliced": its keys are positions start .. base length - 1 of what the
program holds. Read off the view's storage offset and strides; nothing is copied.
"""

from __future__ import annotations

import torch


def note(details: dict, key: torch.Tensor) -> None:
    """details["keys_sliced"] = (start, length) where `key` is a tail slice of its base along the key axis (-2)."""
    try:
        base = key._base
        if base is None or base.dim() != key.dim() or key.dim() < 2 or not key.is_floating_point():
            return
        axis = key.dim() - 2
        length, n = int(base.shape[axis]), int(key.shape[axis])
        if n >= length or any(int(a) != int(b) for i, (a, b) in enumerate(zip(base.shape, key.shape)) if i != axis):
            return
        if tuple(key.stride()) != tuple(base.stride()):
            return  # (a transposed or strided view: not one slice of the key axis)
        start, left = divmod(int(key.storage_offset()) - int(base.storage_offset()), int(base.stride(axis)) or 1)
        if left or start + n != length or start <= 0:
            return
        details["keys_sliced"] = (start, length)
    except (RuntimeError, NotImplementedError, AttributeError):  # (tensor subclasses: no view to read)
        return
