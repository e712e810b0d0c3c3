"""A .npy or .npz file (numpy.save, numpy.savez), read with allow_pickle=False, refusing from its headers what memory
cannot hold. np.load reads either by its signature, whatever the suffix says: one file type for both.

An .npz is a zip: its directory says each member's unpacked size and each member's .npy header its shape and dtype,
so a zip bomb (4 MB of compressed zeros declaring 4 GiB) is refused before a byte of its data is unpacked, and a
member is unpacked only when the caller asks for it by name (`_members`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.tensorfile.base import SLICE_FIX, FileType, Lazy, Reading


def read(path: Path, where: str, reading: Reading = Reading()) -> dict[str, np.ndarray]:
    """Every array in the file by name (a .npy's named ''; an .npz's lazily, each read when asked for), in native
    byte order; Python objects (pickles), members that are not arrays and dtypes that are not numbers refused, and an
    array that with `reading.work` beside it would not fit in memory refused from its headers before it is read."""
    with path.open("rb") as file:
        head = file.read(6)
    # np.load takes anything without the .npy/.npz signature for a pickle, and would call garbage "objects"
    if not head.startswith((b"\x93NUMPY", b"PK\x03\x04", b"PK\x05\x06", b"\x80")):
        raise MaskError(f"{where}: not a numpy file (it does not start with the .npy or .npz signature)")
    if head.startswith(b"PK"):
        import zipfile

        with _numpy_errors(where), zipfile.ZipFile(path) as archive:  # (np.load's NpzFile names its members so)
            listed = archive.namelist()
        return _members(path, where, reading.work, [name.removesuffix(".npy") for name in listed],
                        {name.removesuffix(".npy") for name in listed if name.endswith(".npy")})
    _check_unpacked_fits(path, head, where, reading.work)
    with _numpy_errors(where):
        loaded = np.load(path, allow_pickle=False)
    return {"": _checked(loaded, "", where)}


def _members(path: Path, where: str, work: tuple[float, str], names: list[str], arrays: set[str]) -> Lazy:
    """An .npz's arrays by name, each unpacked when it is first asked for, and refused from its headers (the zip's
    directory and the member's .npy header) where it would not fit in memory with the caller's work beside it: a
    caller that reads two fields of a file unpacks those two, and one that finds none of its names unpacks nothing.
    A member that is no .npy file (`arrays` are those that are) is refused by its name, never unpacked."""

    def load(name: str) -> np.ndarray:
        if name not in arrays:  # (np.load would hand its bytes over, however many the zip inflates them to)
            raise MaskError(f"{where}: member {name!r} is not a .npy array (an .npz holds arrays saved by numpy.savez)")
        _check_unpacked_fits(path, b"PK", where, work, name)
        with _numpy_errors(where), np.load(path, allow_pickle=False) as archive:
            return _checked(archive[name], name, where)

    return Lazy(names, load)


@contextlib.contextmanager
def _numpy_errors(where: str):
    """numpy's refusals of a file as one line: pickles named, a damaged file said to be one."""
    try:
        yield
    except MaskError:
        raise
    except ValueError as error:
        if "pickle" in str(error):  # numpy's refusal of object arrays names allow_pickle
            raise MaskError(f"{where}: refused: it holds Python objects, which would need pickle ({error})") from None
        raise MaskError(f"{where}: not a readable numpy file ({_header_or(error)}): save it again with numpy.save") from None
    except Exception as error:
        raise MaskError(f"{where}: not a readable numpy file ({_header_or(error)}): save it again with numpy.save") from None


def _checked(array, name: str, where: str) -> np.ndarray:
    """An array of numbers in native byte order; a member that is not an array, or not of numbers, refused."""
    if not isinstance(array, np.ndarray):  # np.load hands an .npz member that is not a .npy file over as bytes
        raise MaskError(f"{where}: member {name!r} is not a .npy array (an .npz holds arrays saved by numpy.savez)")
    if array.dtype.kind not in "biuf":
        label = f" {name!r}" if name else ""
        raise MaskError(f"{where}{label}: numpy dtype {array.dtype} cannot be a tensor of numbers")
    # torch takes native byte order only; a big-endian array ('>f4') is swapped here. np.asarray, not
    # np.ascontiguousarray, which makes a 0-d array 1-d and so would read a single number as a mask of one cell
    return np.asarray(array, dtype=array.dtype.newbyteorder("="), order="C")


def _npy_header(stream) -> tuple[int, int, int] | None:
    """(cells, bytes per cell, header bytes) of a .npy stream, read from its header alone; None where it is unreadable."""
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(stream)
        # numpy.lib.format: 1.0 has a 2-byte header length, 2.0 and 3.0 (utf-8 field names) a 4-byte one
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, _, dtype = read(stream)
        return math.prod(shape), dtype.itemsize, stream.tell()
    except Exception:  # a damaged header: np.load says what is wrong with it
        return None


def _check_unpacked_fits(path: Path, head: bytes, where: str, work: tuple[float, str] = (0, "to load"),
                         only: str | None = None) -> None:
    """Refuse a .npy, or an .npz's member named `only`, whose array, as its headers declare it, would not fit in memory (with
    `work`, the bytes per cell the caller needs beside it), before reading it.

    An .npz is a zip: 4 MB of compressed zeros can unpack to 4 GiB, and np.load allocates what each header says.
    The zip's directory says each member's unpacked size; only a member's first bytes (its .npy header) are
    unpacked here, and a member whose header declares more data than the directory says it holds is damaged.
    """
    import zipfile

    from maskcli.memory import check_bytes_fit

    per_cell, how = work
    headers, short = [], []
    if head.startswith(b"\x93NUMPY"):
        with path.open("rb") as file:
            headers.append(_npy_header(file))
    elif head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                for member in archive.infolist():
                    if not member.filename.endswith(".npy") or only is not None and member.filename != only + ".npy":
                        continue
                    with archive.open(member) as stream:
                        found = _npy_header(stream)
                    headers.append(found)
                    if found is not None and found[0] * found[1] > member.file_size - found[2]:
                        short.append((member.filename, found[0] * found[1], member.file_size))
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError, EOFError, ValueError):
            return  # np.load says what is wrong with the archive
    needed = sum(cells * (itemsize + per_cell) for cells, itemsize, _ in filter(None, headers))
    check_bytes_fit(needed, f"{where} ({path.stat().st_size:,} bytes on disk, its arrays as their headers declare them)", how, fix=SLICE_FIX)
    if short:  # np.load would allocate what the header declares, then fail reading it
        name, declared, held = short[0]
        raise MaskError(f"{where}: member {name!r} is damaged: its header declares {declared:,} bytes of data but the "
                        f"archive says it holds {held:,}")


FILE_TYPE = FileType("npy", (".npy", ".npz"), read)


def _header_or(error: BaseException) -> str:
    """What numpy's error says of the file: its header where numpy's parser failed on it (its message then names a
    Python object of numpy's own, "<ast.Name object at 0x...>", nothing of the file), else the message."""
    text = " ".join(str(error).split())
    if "malformed node" in text or " object at 0x" in text or "header" in text.lower() and "ast." in text:
        return "its header is not the dictionary a .npy file starts with (descr, fortran_order, shape)"
    return f"{type(error).__name__}: {text[:160]}"
