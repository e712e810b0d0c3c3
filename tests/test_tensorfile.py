"""tensorfile/: a file goes to the one file type that reads its suffix; a suffix no type reads, a missing or empty
file, and a file whose tensors cannot fit in memory once read are refused before a byte of it is read."""

from __future__ import annotations

import importlib
import re
import struct

import numpy as np
import pytest
import torch

from maskcli import memory
from maskcli.errors import MaskError
from maskcli.tensorfile import FILE_TYPES, MODULES, READ_SUFFIXES, load_tensor, load_tensors, read_tensors
from tensorfile_cli import refused


def test_each_suffix_is_read_by_the_one_module_that_declares_it():
    declared = {}
    for name in MODULES:
        module = importlib.import_module(f"maskcli.tensorfile.{name}")
        for suffix in module.FILE_TYPE.suffixes:
            assert suffix not in declared, suffix
            declared[suffix] = module.FILE_TYPE
        assert module.FILE_TYPE.read is module.read
    assert declared == FILE_TYPES
    assert set(READ_SUFFIXES) == {".pt", ".pth", ".npy", ".npz", ".safetensors", ".json"}


def test_one_mask_written_by_each_library_reads_back_the_same_from_every_file_type(tmp_path):
    keep = np.tril(np.ones((3, 5), dtype=bool), k=2)  # reference: numpy's tril, bottom-right aligned
    torch.save(torch.from_numpy(keep), tmp_path / "m.pt")
    torch.save(torch.from_numpy(keep), tmp_path / "m.pth")
    np.save(tmp_path / "m.npy", keep)
    np.savez(tmp_path / "m.npz", keep)
    (tmp_path / "m.json").write_text(str(keep.astype(int).tolist()))
    for suffix in (".pt", ".pth", ".npy", ".npz", ".json"):
        (name, value), = read_tensors(str(tmp_path / f"m{suffix}"), "--mask").items()
        assert np.array_equal(np.asarray(value).astype(bool), keep), suffix
        assert torch.equal(load_tensors(str(tmp_path / f"m{suffix}"), "--mask")[name].bool(), torch.from_numpy(keep))
    assert list(read_tensors(str(tmp_path / "m.npz"), "--mask")) == ["arr_0"]


def test_a_suffix_no_file_type_reads_is_refused_naming_those_that_are_read(tmp_path):
    (tmp_path / "m.csv").write_text("1,0\n1,1\n")
    with pytest.raises(MaskError, match=r"unknown file type '\.csv'; use one of \.pt, \.pth, \.npy, \.npz, \.safetensors, \.json"):
        read_tensors(str(tmp_path / "m.csv"), "--mask")
    refused(["show", "--mask", tmp_path / "m.csv"], "unknown file type '.csv'")
    refused(["show", "--mask", tmp_path / "gone.npy"], "no such file", ".npy")
    (tmp_path / "empty.npy").write_bytes(b"")
    refused(["show", "--mask", tmp_path / "empty.npy"], "the file is empty")


def test_a_file_past_free_memory_once_read_is_refused_before_it_is_read(tmp_path, monkeypatch):
    text = "[" + ", ".join(["[1, 0, 1, 0]"] * 2000) + "]"  # 28,000 characters: 16 bytes each once numbers
    (tmp_path / "m.json").write_text(text)
    np.save(tmp_path / "m.npy", np.ones((100, 100), dtype=bool))
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 100_000)

    def read_text(*args, **kwargs):
        raise AssertionError("read after all")

    with monkeypatch.context() as patched:
        patched.setattr("pathlib.Path.read_text", read_text)
        with pytest.raises(MaskError, match=r"\(28,000 bytes on disk\) would need 437\.5 KiB \(448,000 bytes\) to read its text into numbers"):
            read_tensors(str(tmp_path / "m.json"), "--mask")
    assert len(text) == 28_000 and 16 * len(text) == 448_000
    assert read_tensors(str(tmp_path / "m.npy"), "--mask")[""].shape == (100, 100)  # 10,128 bytes: within
    refused(["show", "--mask", tmp_path / "m.json"], "28,000 bytes on disk", "to read its text into numbers")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.pt", b"", "the file is empty"),
        ("empty.npy", b"", "the file is empty"),
        # torch reads a non-zip .pt as a legacy pickle, so garbage is refused by the weights_only unpickler
        ("garbage.pt", b"not a torch file at all", "(not a readable .pt file|refused to load with weights_only=True)"),
        ("zipped.pt", b"PK\x03\x04 broken zip", "not a readable .pt file"),
        ("garbage.npy", b"garbage\n", "not a numpy file (it does not start with the .npy or .npz signature)"),
        ("truncated.npy", np.lib.format.magic(1, 0) + b"\x10\x00{'descr'", "not a readable numpy file"),
        ("short.safetensors", b"\x01\x02", "not a readable .safetensors file"),
        ("header.safetensors", struct.pack("<Q", 4) + b"nope", "not a readable .safetensors file"),
        ("bad.json", b"[[1, 2], [3", "not valid JSON"),
        ("ragged.json", b"[[1, 2], [3]]", "not a rectangular nested list"),
        ("words.json", b'[["a", "b"]]', "not a rectangular nested list"),
        ("x.csv", b"1,2\n3,4\n", "unknown file type '.csv'"),
    ],
)
def test_bad_files_give_one_mask_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    pattern = message if message.startswith("(") else re.escape(message)
    with pytest.raises(MaskError, match=pattern) as error:
        read_tensors(str(path), "--q")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("--q ")


def test_missing_file_directory_and_wrong_names(tmp_path):
    with pytest.raises(MaskError, match="no such file"):
        load_tensor(str(tmp_path / "missing.npy"), "--k")
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(MaskError, match="is a directory"):
        load_tensor(str(tmp_path / "dir.pt"), "--k")
    path = tmp_path / "named.npz"
    np.savez(path, a=np.ones((2, 2)), b=np.ones((2, 2)))
    with pytest.raises(MaskError, match="holds 'a', 'b'; expected 'q'"):
        load_tensor(str(path), "--q", ("q",))
    assert set(load_tensors(str(path), "--q")) == {"a", "b"}
