"""The shapes of the tensors an outermost model call was handed: what a new batch states of its own length.

A model handed the same shapes twice (a forecaster handed two batches of series of one context length, a decoder
handed two prompts of one length) runs its first attention pass over them alike, unless state left over from the
first batch changes how it reads the second (checks/restarted.py). Shapes only: nothing is read of the values.
"""

from __future__ import annotations

import torch

NAME = "handed_shapes"
MOST_TENSORS = 8  # tensor arguments kept (a call handed more states its batch in them all the same)


def handed_shapes(given: dict) -> dict:
    """{"handed_shapes": ((name, shape), ...)} of each tensor argument of two axes or more; {} where none."""
    found = []
    for name, value in given.items():
        if issubclass(type(value), torch.Tensor) and value.dim() >= 2:
            found.append((name, tuple(int(n) for n in value.shape)))
            if len(found) == MOST_TENSORS:
                break
    return {NAME: tuple(found)} if found else {}
