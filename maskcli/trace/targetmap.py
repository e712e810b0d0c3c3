"""XLNet's query stream as the model call states it: `target_mapping` (B, P, L), the position each predict stands for.

Kept as bools (B, P, L) with the model call's `labels` where they are (B, P) integers (a predict the loss ignores,
-100, is a padded predict: XLNet's pretraining pads its predictions with all-zero rows). checks/targetmap.py reads them.
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST


def target_mapping(given: dict) -> dict:
    """{"target_mapping": bool (B, P, L), ["target_labels": int (B, P)]} of the model call, else {}."""
    value = given.get("target_mapping")
    if not issubclass(type(value), torch.Tensor) or value.dim() != 3 or value.numel() > MOST or value.device.type == "meta":
        return {}
    found = {"target_mapping": (value.detach() != 0).cpu().numpy()}
    labels = given.get("labels")
    if issubclass(type(labels), torch.Tensor) and tuple(labels.shape) == tuple(value.shape[:2]) \
            and not labels.is_floating_point():
        found["target_labels"] = labels.detach().cpu().numpy().astype(np.int64)
    return found
