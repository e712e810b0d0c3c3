"""A mask the model call is handed under a name that says causal (`decoder_causal_mask`, `causal_mask`, `causal_bias`):
the program's own word of what those cells must be (checks/namedcausal.py reads it).

Read where it is a float additive mask over (L, L), with any leading axes of size 1 or rows (B, 1, L, L): every cell 0
(kept) or at most -1e4 (masked: -inf, finfo.min, -1e9), its keep cells kept as bool (B, L, L); or a bool mask whose
diagonal is True (True = keep, each token sees itself). Nothing else is read (a 0/1 float mask, a bias of other
values: its polarity is not known).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.checks.causalname import named

MOST = 1 << 16  # cells read at most


def causal_arg(given: dict) -> dict:
    """{"causal_named": (name, bool keep (B, L, L))}: the first argument named causal that is such a mask; {} else."""
    for name, value in given.items():
        if not isinstance(name, str) or "causal" not in name.lower() or not named(name) \
                or not issubclass(type(value), torch.Tensor) or value.dim() < 2 or value.device.type == "meta":
            continue
        length = value.shape[-1]
        if value.shape[-2] != length or length < 2 or value.numel() > MOST or value.is_complex() \
                or any(size != 1 for size in value.shape[1:-2]):
            continue
        cells = value.detach().cpu().reshape(-1, length, length)
        if value.is_floating_point():
            kept = cells == 0
            if not bool((kept | (cells <= -1e4)).all()):
                continue
        elif value.dtype == torch.bool:
            kept = cells
            if not bool(torch.diagonal(kept, dim1=1, dim2=2).all()):
                continue
        else:
            continue
        return {"causal_named": (name, np.array(kept.numpy(), dtype=bool))}
    return {}
