"""A mask over a model call's cells that the call was handed as an argument (checks/handedcausal.py reads it).

A (B, L, L) or (B, 1, L, L) mask of bools or 0/1 integers handed to the outermost module's forward, by name or as an
item of a tuple or list argument (Megatron's and DeepSpeed's pipeline models take `(tokens, position_ids,
attention_mask)` as one `inputs` tuple): what the program states each query may see, its polarity unsaid. Read once
per model call, small masks only (MOST cells).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST

ITEMS = 8  # items of a tuple or list argument looked at


def handed_cells(given: dict) -> dict:
    """{"handed_cells": (name, bool (B, L, L))}: the first such mask among the call's arguments; {} where none."""
    for name, value in given.items():
        items = list(enumerate(value))[:ITEMS] if isinstance(value, (tuple, list)) else [(None, value)]
        for at, each in items:
            if not issubclass(type(each), torch.Tensor) or each.dim() not in (3, 4) or each.device.type == "meta":
                continue
            if each.dim() == 4 and each.shape[1] != 1 or each.shape[-1] != each.shape[-2] or each.shape[-1] < 2 \
                    or each.numel() > MOST or each.is_floating_point() or each.is_complex():
                continue
            cells = each.detach().cpu().reshape(each.shape[0], each.shape[-2], each.shape[-1])
            if cells.dtype != torch.bool:
                if not bool(((cells == 0) | (cells == 1)).all()):
                    continue
                cells = cells != 0
            return {"handed_cells": (name if at is None else f"{name}[{at}]", np.array(cells.numpy(), dtype=bool))}
    return {}
