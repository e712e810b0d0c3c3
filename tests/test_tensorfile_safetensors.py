"""tensorfile/safetensors.py: a .safetensors file parsed without the safetensors package (header length, JSON
header, little-endian bytes); a damaged header, offsets that do not hold a tensor's bytes, and dtypes that cannot
be used are refused naming the tensor."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from maskcli.errors import MaskError
from maskcli.tensorfile import dtype_name, load_tensors, read_tensors
from maskcli.tensorfile.safetensors import read
from tensorfile_cli import refused


def written(path, tensors: dict, header: dict | None = None) -> None:
    """A .safetensors file as the format's spec lays it out, each tensor's bytes little-endian, written here."""
    entries, data = {}, b""
    for name, (code, shape, raw) in tensors.items():
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header if header is not None else entries).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_each_dtype_reads_back_as_torch_holds_it(tmp_path):
    keep = np.tril(np.ones((2, 3), dtype=bool))
    bias = np.array([[0.5, -1.0], [2.0, -np.inf]], dtype="<f4")
    ids = np.array([1, -2, 3], dtype="<i8")
    brain = torch.tensor([1.5, -2.25, 3.0e38], dtype=torch.bfloat16)  # bfloat16: float32's top 16 bits
    written(tmp_path / "m.safetensors", {"keep": ("BOOL", [2, 3], keep.tobytes()), "bias": ("F32", [2, 2], bias.tobytes()),
                                          "ids": ("I64", [3], ids.tobytes()), "brain": ("BF16", [3], brain.view(torch.int16).numpy().astype("<i2").tobytes())})
    got = read(tmp_path / "m.safetensors", "m")
    assert np.array_equal(got["keep"], keep) and np.array_equal(got["bias"], bias) and np.array_equal(got["ids"], ids)
    assert got["brain"].dtype.metadata == {"name": "bfloat16"} and got["brain"].tolist() == brain.float().tolist()


def test_a_damaged_file_is_refused_naming_what_is_wrong(tmp_path):
    written(tmp_path / "short.safetensors", {"m": ("F32", [4], np.zeros(2, dtype="<f4").tobytes())},
            header={"m": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    with pytest.raises(MaskError, match=r"tensor 'm' has data_offsets \[0, 16\], which do not hold its 16 bytes inside the file's 8"):
        read(tmp_path / "short.safetensors", "short")
    (tmp_path / "cut.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(MaskError, match=r"damaged: its header says it is 1,000 bytes long, but the file has 10"):
        read(tmp_path / "cut.safetensors", "cut")
    written(tmp_path / "odd.safetensors", {"m": ("F8_E4M3", [1], b"\x00")})
    with pytest.raises(MaskError, match=r"tensor 'm' has dtype F8_E4M3, which cannot be used here"):
        read(tmp_path / "odd.safetensors", "odd")
    written(tmp_path / "shape.safetensors", {}, header={"m": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}})
    with pytest.raises(MaskError, match=r"tensor 'm' has shape \[-1\]; a shape is a list of sizes of 0 or more"):
        read(tmp_path / "shape.safetensors", "shape")
    # true and false are ints to Python; a name given twice json would keep the last of silently: each was read, exit 0
    written(tmp_path / "bool.safetensors", {"m": ("U8", [2], b"\x01\x01")}, header={"m": {"dtype": "U8", "shape": [2], "data_offsets": [False, 2]}})
    with pytest.raises(MaskError, match=r"tensor 'm' has data_offsets \[False, 2\], which do not hold its 2 bytes"):
        read(tmp_path / "bool.safetensors", "bool")
    (tmp_path / "twice.safetensors").write_bytes(struct.pack("<Q", len(twice := b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                                                         b'"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')) + twice + b"\x01\x01")
    refused(["inspect", tmp_path / "twice.safetensors"], "twice.safetensors", "the header names tensor 'a' twice: the file is damaged")
    (tmp_path / "text.safetensors").write_bytes(struct.pack("<Q", 5) + b"nope!")
    refused(["show", "--mask", tmp_path / "text.safetensors"], "text.safetensors", "not a readable .safetensors file")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool])
def test_safetensors_are_read_by_numpy_as_torch_reads_them(tmp_path, dtype):
    values = torch.tensor([[0.0, -3.3895313892515355e38, 1.0], [-1e9, 0.5, 7.0]]).to(dtype)
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()  # torch's own bytes (little-endian here)
    code = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL"}[dtype]
    header = json.dumps({"m": {"dtype": code, "shape": [2, 3], "data_offsets": [0, len(raw)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    array = read_tensors(str(tmp_path / "m.safetensors"), "FILE")["m"]
    assert isinstance(array, np.ndarray) and dtype_name(array) == str(dtype).removeprefix("torch.")
    assert array.tolist() == values.float().tolist() if dtype == torch.bfloat16 else array.tolist() == values.tolist()
    loaded = load_tensors(str(tmp_path / "m.safetensors"), "FILE")["m"]  # the torch view: bfloat16 again, bit for bit
    assert loaded.dtype == dtype and torch.equal(loaded.view(torch.uint8), values.view(torch.uint8))
