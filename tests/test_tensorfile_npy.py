"""tensorfile/npy.py: .npy and .npz files read with allow_pickle=False, in native byte order; an .npz whose members'
headers declare more than memory holds (a zip bomb) is refused from its headers, before a byte is unpacked."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from maskcli import memory
from maskcli.errors import MaskError
from maskcli.tensorfile.base import Reading
from maskcli.tensorfile.npy import read
from tensorfile_cli import refused


def test_npy_and_npz_read_back_as_numpy_saved_them_in_native_byte_order(tmp_path):
    keep = np.tril(np.ones((3, 4), dtype=bool), k=1)
    np.save(tmp_path / "m.npy", keep)
    np.savez(tmp_path / "two.npz", mask=keep, bias=np.arange(6, dtype=">f4").reshape(2, 3))
    assert np.array_equal(read(tmp_path / "m.npy", "m")[""], keep)
    got = read(tmp_path / "two.npz", "two")
    assert np.array_equal(got["mask"], keep) and list(got) == ["mask", "bias"]
    assert got["bias"].dtype == np.dtype("float32") and got["bias"].dtype.isnative
    assert got["bias"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def bomb(path, shape=(65536, 65536), held=1000):
    """An .npz whose member's header (numpy.lib.format's own writer) declares `shape` bools over `held` zero bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|b1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mask.npy", header.getvalue() + bytes(held))


def test_a_zip_bomb_is_refused_from_its_headers_before_np_load_unpacks_it(tmp_path, monkeypatch):
    bomb(tmp_path / "bomb.npz")  # 4.3 GB declared, a few kB on disk
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 1 << 30)

    def unpacked(*args, **kwargs):
        raise AssertionError("np.load was called")

    with monkeypatch.context() as patched:
        patched.setattr(np, "load", unpacked)
        with pytest.raises(MaskError, match=r"its arrays as their headers declare them\) would need 4\.0 GiB \(4,294,967,296 bytes\) to load"):
            read(tmp_path / "bomb.npz", "bomb")
        # with the work the caller does beside it (3 bytes a cell to read as a mask), four times that
        with pytest.raises(MaskError, match=r"would need 16\.0 GiB \(17,179,869,184 bytes\) to read as a mask"):
            read(tmp_path / "bomb.npz", "bomb", Reading(work=(3, "to read as a mask")))
    refused(["show", "--mask", tmp_path / "bomb.npz"], "as their headers declare them", "to read as a mask")


def test_a_member_declaring_more_than_it_holds_is_damaged(tmp_path):
    bomb(tmp_path / "short.npz", shape=(100, 100), held=10)
    with pytest.raises(MaskError, match=r"member 'mask.npy' is damaged: its header declares 10,000 bytes of data but the archive says it holds"):
        read(tmp_path / "short.npz", "short")


def test_objects_garbage_and_text_are_refused_in_one_line(tmp_path):
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(MaskError, match=r"refused: it holds Python objects, which would need pickle"):
        read(tmp_path / "objects.npy", "objects")
    (tmp_path / "garbage.npy").write_bytes(b"not numpy at all")
    with pytest.raises(MaskError, match=r"not a numpy file \(it does not start with the .npy or .npz signature\)"):
        read(tmp_path / "garbage.npy", "garbage")
    np.save(tmp_path / "words.npy", np.array(["a", "b"]))
    with pytest.raises(MaskError, match=r"numpy dtype <U1 cannot be a tensor of numbers"):
        read(tmp_path / "words.npy", "words")
    refused(["show", "--mask", tmp_path / "objects.npy"], "objects.npy", "Python objects")
