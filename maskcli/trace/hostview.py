"""A numpy view of a tensor's cells that leaves the program's storage as it was.

`Tensor.numpy()` marks the tensor's storage not resizable, for good, even once the array is gone: a program that grows
its KV cache in place with `resize_` (nanochat's KVCache.insert_kv before b062b42) raised "Trying to resize storage
that is not resizable" under trace where python ran it. numpy's DLPack import shares the same memory (no copy), holds
the tensor alive while the array lives, and leaves the storage's flags alone. A tensor on another device is copied
to the host (its storage untouched); a dtype DLPack cannot carry (bfloat16) raises TypeError, as `.numpy()` does.
"""

from __future__ import annotations

import numpy as np
import torch


def host(t: torch.Tensor) -> np.ndarray:
    """`t`'s cells as a numpy array: a view of a CPU tensor's own memory, its storage still resizable; a copy else."""
    t = t.detach() if t.requires_grad else t
    if t.device.type != "cpu":
        return t.cpu().numpy()
    try:
        return np.from_dlpack(t)
    except (BufferError, RuntimeError, ValueError) as error:
        raise TypeError(f"no numpy view of a {t.dtype} tensor: {error}") from None
