"""A .safetensors file, parsed here without the safetensors package and without torch: an 8-byte little-endian
header length, a JSON header (each tensor's dtype, shape and data_offsets), then the raw little-endian bytes.
Nothing in it is run; every offset is checked to hold its tensor's bytes inside the file before it is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.files import SAFETENSORS_DTYPES
from maskcli.tensorfile.base import BFLOAT16, FileType, Reading, short

# the codes safetensors writes, by numpy's dtype names (files.py writes them), and bfloat16
_SAFETENSORS_DTYPES = {code: np.dtype(name) for name, code in SAFETENSORS_DTYPES.items()} | {"BF16": BFLOAT16}


def read(path: Path, where: str, reading: Reading = Reading()) -> dict[str, np.ndarray]:
    """Every tensor in the file by name, as numpy arrays (bfloat16 widened to BFLOAT16); a damaged header or
    offsets that do not hold a tensor's bytes are one line naming the tensor."""
    data = path.read_bytes()
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        if 8 + header_len > len(data):
            raise MaskError(f"{where}: not a readable .safetensors file (damaged: its header says it is {header_len:,} bytes long, but the file has {len(data):,})")
        header = json.loads(data[8 : 8 + header_len], object_pairs_hook=_unique)
        base = 8 + header_len
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise MaskError(f"{where}: tensor {name!r} has dtype {info['dtype']}, which cannot be used here")
            start, end = info["data_offsets"]
            shape = info["shape"]
            if not (isinstance(shape, list) and all(_whole(n) and n >= 0 for n in shape)):
                raise MaskError(f"{where}: tensor {name!r} has shape {short(shape)}; a shape is a list of sizes of 0 or more")
            size = math.prod(shape) * (2 if dtype is BFLOAT16 else dtype.itemsize)
            if not (_whole(start) and _whole(end) and 0 <= start <= end <= len(data) - base and end - start == size):
                raise MaskError(
                    f"{where}: tensor {name!r} has data_offsets {short(info['data_offsets'])}, which do not hold its "
                    f"{size:,} bytes inside the file's {len(data) - base:,}: the file is damaged"
                )
            raw = bytearray(data[base + start : base + end])  # a copy that can be written, as torch wants
            if dtype is BFLOAT16:  # bfloat16 is float32's top 16 bits
                array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(BFLOAT16)
            else:
                array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype.newbyteorder("="), copy=False)
            tensors[name] = array.reshape(shape)
        return tensors
    except MaskError:
        raise
    except _Twice as twice:
        raise MaskError(f"{where}: the header names tensor {twice.args[0]!r} twice: the file is damaged (write it again with safetensors)") from None
    except Exception as error:
        raise MaskError(f"{where}: not a readable .safetensors file ({type(error).__name__}: {str(error)[:160]})") from None


class _Twice(ValueError):
    """A name the header gives twice."""


def _whole(value) -> bool:
    """An int that JSON wrote as a number: true and false are ints to Python, not sizes or offsets."""
    return isinstance(value, int) and not isinstance(value, bool)


def _unique(pairs: list) -> dict:
    """A header object whose names are each given once: json would keep the last of two silently."""
    names = [name for name, _ in pairs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise _Twice(twice)
    return dict(pairs)


FILE_TYPE = FileType("safetensors", (".safetensors",), read)
