"""What a tensor file type declares (`FileType`), and what a caller asks of a read (`Reading`).

A file type is one module of this package with a `FILE_TYPE`: its name, the suffixes it reads, its `read(path or
text, where, reading) -> {name: tensor}` and how many bytes of memory a byte of it may take once read (the refusal
before reading, in tensorfile's `read_tensors`). numpy has no bfloat16: such a tensor is widened to float32 (exactly:
bfloat16 is float32's top 16 bits) with the dtype BFLOAT16, whose metadata keeps its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np

BFLOAT16 = np.dtype(np.float32, metadata={"name": "bfloat16"})  # a bfloat16 tensor's values, widened exactly
SLICE_FIX = "slice the tensor you need into a smaller file first (like mask[0, 0]), or run where there is more memory"


@dataclass(frozen=True)
class Reading:
    """What the caller asks of a read, each file type taking what applies to it.

    `floats`: the numpy dtype JSON's floats become (JSON carries no dtype); `numbers`: a .pt dict's plain ints and
    lists of ints are tensors too (a collator's max_length_q is a Python int); `lists`: the fields (of a JSON object
    or a .pt dict) kept as the nested lists they are (a ragged choice list); `work`: (bytes per cell, what for) the
    caller needs beyond the arrays themselves, so that an .npz too large for it is refused from its headers."""

    floats: str = "float32"
    numbers: bool = False
    lists: tuple[str, ...] = ()
    work: tuple[float, str] = (0, "to load")


@dataclass(frozen=True)
class FileType:
    name: str
    suffixes: tuple[str, ...]  # lower case, with the dot
    read: Callable  # read(path: Path, where: str, reading: Reading) -> dict of numpy arrays (torch tensors for .pt)
    bytes_per_byte: int = 1  # memory a byte of the file may take once read: refused up front past what is free
    how: str = "to load"  # what that memory is for, in the refusal


def short(value) -> str:
    """A value in a message: its repr on one line, cut to 40 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


class Lazy(Mapping):
    """Values by name, each made by `load(name)` when first asked for and kept: an .npz's members unpacked only where a
    command reads them (npy._members), and what commands make of them (as torch tensors, as batch metadata)."""

    def __init__(self, names, load: Callable):
        self.names, self.load, self.made = list(names), load, {}

    def __getitem__(self, name):
        if name not in self.made:
            if name not in self.names:
                raise KeyError(name)
            self.made[name] = self.load(name)
        return self.made[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name) -> bool:  # (Mapping's own would make the value to find it there)
        return name in self.names
