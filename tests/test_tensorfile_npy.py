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


def bomb(path, shape=(65536, 65536), held=1000, name="mask", others=None):
    """An .npz whose member `name`'s header (numpy.lib.format's own writer) declares `shape` bools over `held` zero
    bytes, beside the arrays `others` (written by numpy.lib.format too)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|b1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{name}.npy", header.getvalue() + bytes(held))
        for key, array in (others or {}).items():
            data = io.BytesIO()
            np.lib.format.write_array(data, array)
            archive.writestr(f"{key}.npy", data.getvalue())


def test_a_zip_bomb_is_refused_from_its_headers_before_np_load_unpacks_it(tmp_path, monkeypatch):
    bomb(tmp_path / "bomb.npz")  # 4.3 GB declared, a few kB on disk
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 1 << 30)

    def unpacked(*args, **kwargs):
        raise AssertionError("np.load was called")

    with monkeypatch.context() as patched:
        patched.setattr(np, "load", unpacked)
        members = read(tmp_path / "bomb.npz", "bomb")  # (named from the zip's directory: nothing unpacked yet)
        assert list(members) == ["mask"] and "mask" in members and "bias" not in members
        with pytest.raises(MaskError, match=r"its arrays as their headers declare them\) would need 4\.0 GiB \(4,294,967,296 bytes\) to load"):
            members["mask"]
        # with the work the caller does beside it (3 bytes a cell to read as a mask), four times that
        with pytest.raises(MaskError, match=r"would need 16\.0 GiB \(17,179,869,184 bytes\) to read as a mask"):
            read(tmp_path / "bomb.npz", "bomb", Reading(work=(3, "to read as a mask")))["mask"]
    refused(["show", "--mask", tmp_path / "bomb.npz"], "as their headers declare them", "to read as a mask")


def test_a_member_declaring_more_than_it_holds_is_damaged(tmp_path):
    bomb(tmp_path / "short.npz", shape=(100, 100), held=10)
    with pytest.raises(MaskError, match=r"member 'mask.npy' is damaged: its header declares 10,000 bytes of data but the archive says it holds"):
        read(tmp_path / "short.npz", "short")["mask"]


def test_a_member_nobody_asks_for_is_never_unpacked(tmp_path, monkeypatch):
    """pack, serve and export --from read the fields they know by name: a 4 GiB member beside them (or instead of
    them) is neither unpacked nor refused, and what the command says of the file is its own message, at once."""
    ids = np.array([[1, 2, 3, 4]])
    bomb(tmp_path / "with_ids.npz", others={"input_ids": ids})
    bomb(tmp_path / "only_mask.npz")
    bomb(tmp_path / "queries.npz", name="query_start_loc", shape=(1 << 29,))
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 1 << 30)
    members = read(tmp_path / "with_ids.npz", "with_ids")
    assert np.array_equal(members["input_ids"], ids) and set(members) == {"mask", "input_ids"}
    refused(["pack", tmp_path / "only_mask.npz"], "holds 'mask', none of them a field maskcli reads")
    refused(["serve", tmp_path / "queries.npz"], "holds vLLM CommonAttentionMetadata but no seq_lens or seq_lens_cpu; add it to the file")
    refused(["export", "--mask", tmp_path / "only_mask.npz", "--from", "flashmask", "--for", "sdpa"],
            "the file has no tensor 'startend_row_indices' (it has mask)")
    # a member that is no .npy file, asked for by name, is refused by it: np.load would inflate its bytes, however many
    with zipfile.ZipFile(tmp_path / "text.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("input_ids", bytes(1 << 20))
    with monkeypatch.context() as patched:
        patched.setattr(np, "load", lambda *args, **kwargs: pytest.fail("np.load was called"))
        with pytest.raises(MaskError, match=r"member 'input_ids' is not a .npy array"):
            read(tmp_path / "text.npz", "text")["input_ids"]
    # the one member pack reads is refused from its header with the work pack does beside it (256 bytes a token)
    bomb(tmp_path / "ids_bomb.npz", name="input_ids", shape=(1 << 24,))
    refused(["pack", tmp_path / "ids_bomb.npz"], "would need 4.0 GiB (4,311,744,512 bytes) to check as a batch")


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
