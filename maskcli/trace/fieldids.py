"""A compound-word model's ids: the model call's first argument as (B, L, F) integer ids, one field per last axis.

A compound-word music transformer (CP-Transformer, MIDI-Transformer's CPTransformer) hands its model one token per
position made of F fields (type, position, pitch, duration, ...), `forward(self, x)` with x (B, L, F) integers, and
trains each field's head on the next position's field (`labels = seq[:, 1:]`, `X = seq[:, :-1]`). Where the call
keeps no 2-D ids (by name, or its first argument's: tops.py), its first argument of that form is kept as
`field_ids` = (name, (B, L, F) int64), so that a loss whose targets are one field of the next position reads it as a
next-token loss (trace/losses.py).
"""

from __future__ import annotations

import numpy as np
import torch

NAMED = ("input_ids", "idx", "tokens", "src", "inputs", "source", "src_ids", "src_tokens")  # ids kept by name
FIELDS = 64  # fields of one compound token at most (more: no token of fields, a feature map)


def field_ids(signature, given: dict, found: dict, most: int) -> dict:
    """{"field_ids": (name, (B, L, F) int64 ids)}, or {} where the call keeps ids already or its first argument is no
    such tensor (at most `most` cells)."""
    if signature is None or "first_ids" in found or any(isinstance(found.get(n), np.ndarray) for n in NAMED):
        return {}
    name = next((n for n in signature.parameters if n != "self"), None)
    value = given.get(name)
    if issubclass(type(value), torch.Tensor) and value.dim() == 3 and 2 <= value.shape[-1] <= FIELDS \
            and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool \
            and value.numel() <= most and value.device.type != "meta":
        return {"field_ids": (name, value.detach().cpu().numpy().astype(np.int64))}
    return {}
