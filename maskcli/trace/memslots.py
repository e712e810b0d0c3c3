"""A recurrent memory's slots stated twice at a model call: a 0/1 mask of its valid slots and the memory itself, exactly
zero in the slots nobody wrote yet (checks/memflip.py holds the two against the attention: memory-slots-inverted).

An episodic-memory agent (neroRL's and episodic-transformer-memory-ppo's TrXL) gathers a window of S slots from a
zero-initialised buffer of past hidden states and hands the model a (B, S) mask, 1 where the slot holds a step already
written: the slots the mask calls invalid are the buffer's zeros. Read at an outermost model call: a float argument
(B, S, ...) of three or more axes whose slots (every trailing axis) are exactly zero on precisely the zeros of a 0/1
(B, S) argument named as a mask, in some row beside a valid slot.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from maskcli.trace.hostview import host

MASK = re.compile(r"^(?:\w+_)?masks?$")  # (`mask`, `memory_mask`: 1 = a valid slot; a padding mask's name is not read)
PAD = re.compile(r"(?:^|_)(?:pad|padding)_masks?$")
MOST = 1 << 20  # elements of one argument read at most


def memory_slots(given: dict) -> dict:
    """{"memory_slots": (mask name, bool (B, S) valid slots, memory name)}, or {}."""
    masks = [(name, value) for name, value in given.items() if MASK.search(name) and not PAD.search(name)
             and issubclass(type(value), torch.Tensor) and value.dim() == 2 and value.shape[1] > 1
             and value.numel() <= MOST and value.device.type != "meta"]
    for name, mask in masks:
        memories = [(other, data) for other, data in given.items() if issubclass(type(data), torch.Tensor)
                    and data.dim() >= 3 and data.is_floating_point() and tuple(data.shape[:2]) == tuple(mask.shape)
                    and data.numel() <= MOST and data.device.type != "meta"]
        if not memories:  # (shapes first: the mask's values are read only beside a memory of its slots)
            continue
        rows = host(mask)
        if not np.isin(rows, (0, 1)).all():
            continue
        valid = rows != 0
        if not (valid.any(axis=1) & ~valid.all(axis=1)).any():
            continue  # (no row with a valid slot beside an invalid one: nothing to tell the polarity by)
        for other, data in memories:
            zero = (data.detach() == 0).flatten(2).all(dim=2).cpu().numpy()
            if (zero == ~valid).all():
                return {"memory_slots": (name, valid, other)}
    return {}


def memory_length(module) -> dict:
    """{"mem_len": int}: the outermost module's own `mem_len` as this call ran (checks/memlen.py), where it holds one: a
    model re-lengthed between training and evaluation (NVIDIA's Transformer-XL `reset_length`, written blind as
    quiet-r128a) states another memory at each, and the configs read once the run is over hold its last."""
    value = vars(module).get("mem_len")
    return {"mem_len": value} if type(value) is int and value > 0 else {}
