"""tensorfile/: a file goes to the one file type that reads its suffix; a suffix no type reads, a missing or empty
file, and a file whose tensors cannot fit in memory once read are refused before a byte of it is read."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from maskcli import memory
from maskcli.errors import MaskError
from maskcli.tensorfile import FILE_TYPES, MODULES, READ_SUFFIXES, load_tensors, read_tensors
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
