"""A model call's padding stated twice: a 0/1 mask named as a padding mask beside a float input that is exactly zero
across the mask's padded run (checks/padded.py holds the two against the attention: zero-padding-attended)."""

from __future__ import annotations

import re

import numpy as np
import torch

MOST = 1 << 20  # elements of one model-call argument kept (a batch's 2-D ids; never a 4-D mask): tops.py's too


_PADDING_NAME = re.compile(r"^(?:\w+_)?(?:attention|padding|pad)_mask$|^(?:input_)?mask$")  # (padding_, pad_: True = pad)


def padded_input(given: dict) -> dict:
    """{"padded_input": (mask name, its values (S,) or (B, S), input name, bool (B, S) where the input is exactly 0)}:
    a model call handed a 0/1 mask named as a padding mask with a 0 in it (any dtype, 1-D too: a forecaster's
    `mask=input_mask`) beside a float input (B, S) or (B, C, S) / (B, S, C) with an axis of the mask's S samples: the
    data's own padding, to hold the mask against (checks/padded.py). Read only where such a mask is handed."""
    masks = [(name, value) for name, value in given.items() if isinstance(value, torch.Tensor) and _PADDING_NAME.search(name)
             and value.dim() in (1, 2) and 1 < value.shape[-1] and value.numel() <= MOST and value.device.type != "meta"]
    for name, value in masks:
        values = value.detach().cpu()
        if not bool(((values == 0) | (values == 1)).all()) or bool(values.bool().all()) or not bool(values.bool().any()):
            continue
        length = values.shape[-1]
        for other, data in given.items():
            if other == name or not isinstance(data, torch.Tensor) or not data.is_floating_point() \
                    or data.dim() not in (2, 3) or data.numel() > MOST or data.device.type == "meta":
                continue
            if data.dim() == 2 and data.shape[1] == length:
                zero = (data.detach() == 0).cpu().numpy()
            elif data.dim() == 3 and data.shape[2] == length:
                zero = (data.detach() == 0).all(1).cpu().numpy()  # (B, C, S)
            elif data.dim() == 3 and data.shape[1] == length:
                zero = (data.detach() == 0).all(2).cpu().numpy()  # (B, S, C)
            else:
                continue  # (no axis of the mask's samples: not compared, so no pass over its cells)
            return {"padded_input": (name, values.numpy().astype(np.int64), other, zero)}
    return {}
