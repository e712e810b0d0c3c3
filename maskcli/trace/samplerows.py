"""Each row of a model call's tensor arguments, told apart cheaply: which call runs one sample of another alone.

A program that runs its model on a batch and again on one row of it (`model(x[i:i + 1])`, a reference computed one
sample at a time) states that the first axis of those arguments is the batch: each of its rows is a sample of its own
(checks/batchaxis.py reads the attention calls of both). Kept per tensor argument (a tuple's, `*inputs`, one by one)
of at most MOST elements: its first axis's length and one hash per row of its bytes.
"""

from __future__ import annotations

import torch

from maskcli.trace.padded import MOST


def _rows(value) -> tuple | None:
    """(one hash per row of the tensor's first axis) of a small tensor on the CPU or a device, else None."""
    if not issubclass(type(value), torch.Tensor) or value.dim() < 2 or value.numel() > MOST \
            or value.device.type == "meta" or value.is_complex():
        return None
    held = value.detach().cpu().contiguous()
    try:
        held = (held.view(torch.int16) if held.dtype == torch.bfloat16 else held).numpy()
    except TypeError:  # (a dtype numpy has no word for: float8)
        return None
    return tuple(hash(row.tobytes()) for row in held)


def sample_rows(given: dict) -> tuple:
    """((name, row hashes), ...): every small tensor argument of a call (one of a tuple or list named name[i])."""
    found = []
    for name, value in given.items():
        values = [(f"{name}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (tuple, list)) \
            and len(value) <= 8 else [(name, value)]
        for named, one in values:
            rows = _rows(one)
            if rows is not None:
                found.append((named, rows))
    return tuple(found)
