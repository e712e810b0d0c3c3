"""The labels a model call is handed (`labels`, transformers' name for what its loss trains on), kept for trace/losses.py.

A causal LM given `labels` computes its loss in its own forward, on the logits of positions 0 .. L-2 against the labels
of positions 1 .. L-1 (transformers' `ForCausalLMLoss`: `shift_labels = labels[..., 1:]`). Its labels need not be its
input ids: a music model's are its compound tokens' fields remapped to the heads' vocabulary (Moonbeam's 7 columns
beside 6 id fields), a speech-unit LM's the units without the special-token offset of its ids. Kept as int64
(B, L) or (B, L, F), integers only, at most MOST elements, so that a loss whose targets are these labels shifted by one
position reads as a next-token loss (losses.py) even where they are not the ids.
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.padded import MOST

NAMES = ("labels", "lm_labels")  # what the model call's own loss trains on, as transformers and GPT-2 double-heads name it


def shifted_labels(given: dict) -> dict:
    """{"loss_labels": (name, int64 (B, L[, F]))} of the model call's labels, else {}."""
    for name in NAMES:
        value = given.get(name)
        if issubclass(type(value), torch.Tensor) and value.dim() in (2, 3) and value.shape[1] >= 2 \
                and value.numel() <= MOST and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool and value.device.type != "meta":
            return {"loss_labels": (name, value.detach().cpu().numpy().astype(np.int64))}
    return {}
