"""A model call handed a batch that a torch DataLoader collated: its first axis is the samples.

torch.utils.data.DataLoader's default collate stacks the samples of a batch along a new first axis (default_collate:
`torch.stack(batch, 0)`), so a tensor it yields is (batch_size, ...) whatever each sample's layout is. Where a function
of the program that made a model call holds such a loader (its default collate, a batch_size B) and the tensor the
model was handed first is (B, T, D) with T != B (the batch it drew, or the copy `.to(device)` made), the program
states that the call's first axis is its samples and its second their steps (checks/batchaxis.py reads it: a call of
that model whose keys are the B samples and whose batch rows the T steps attends across the batch, BreizhCrops#20).
A loader with a collate_fn of the program's own (a time-major `pad_sequence`) states nothing, nor does an image's
(B, C, H, W). Read once per outermost model call, from a few frames' variables (no tensor copied).
"""

from __future__ import annotations

import os

import torch

from maskcli.trace.held import program_frames
from maskcli.trace.modules import forward_signature

FRAMES = 4  # the program's frames searched, from the one that made the call


def _parameters(cls) -> tuple:
    """The names of `cls.forward`'s parameters after self (its signature read once a class: modules.py's cache)."""
    try:
        return tuple(name for name in forward_signature(cls).parameters if name != "self")
    except (TypeError, ValueError):
        return ()


def _first(module, args: tuple, kwargs: dict) -> tuple[str, torch.Tensor] | None:
    """(name, tensor) of the first tensor argument of the call, where it is 3-D (a batch of sequences of features; an
    image's (B, C, H, W) has channels, not steps, on its second axis)."""
    names = _parameters(type(module))
    given = [*zip(names or [f"argument {n}" for n in range(len(args))], args), *kwargs.items()]
    for name, value in given:
        if issubclass(type(value), torch.Tensor):
            return (name, value) if value.dim() == 3 else None
    return None


def _default(loader) -> bool:
    from torch.utils.data._utils.collate import default_collate

    return getattr(loader, "collate_fn", None) is default_collate and isinstance(getattr(loader, "batch_size", None), int)


def loader_batch(module, args: tuple, kwargs: dict, caller) -> dict:
    """{"loader_batch": (argument name, B, T, the loader's name, where it is held)}, else {}."""
    first = _first(module, args, kwargs)
    if first is None or caller is None:
        return {}
    name, tensor = first
    samples, tokens = int(tensor.shape[0]), int(tensor.shape[1])
    if samples < 2 or tokens < 2 or samples == tokens:
        return {}
    from torch.utils.data import DataLoader

    for frame in program_frames(caller, FRAMES):
        for held, loader in list(frame.f_locals.items()):
            if isinstance(loader, DataLoader) and _default(loader) and loader.batch_size == samples:
                code = frame.f_code
                at = "the top" if code.co_name == "<module>" else f"{code.co_name}()"
                return {"loader_batch": (name, samples, tokens, held, f"{at} of {os.path.basename(code.co_filename)}")}
    return {}
