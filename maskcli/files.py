"""Output paths: checked before any work is done, written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from maskcli.errors import MaskError

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
TENSOR_SUFFIXES = (".pt", ".npy", ".pth")  # (.pth: torch.save's file, as .pt; read as one too)


def state(path: Path) -> str:
    """'file', 'dir', 'missing', 'special' (a FIFO, device or socket), or why the path cannot be looked at."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as error:  # a name too long, a loop of links, no permission
        return error.strerror or type(error).__name__
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "special"


def readable_file(source: str, where: str) -> Path:
    """The path of an existing regular file, or a MaskError that says what it is instead."""
    path = Path(source)
    found = state(path)
    if found == "file":
        return path
    if found == "missing":
        raise MaskError(f"{where}: no such file")
    if found == "dir":
        raise MaskError(f"{where} is a directory; give a file")
    if found == "special":
        raise MaskError(f"{where} is not a regular file (a FIFO, a device or a socket): save the tensor to a file first")
    raise MaskError(f"{where}: cannot open it ({found})")


def is_inline(text: str) -> bool:
    """Inline JSON like '[[1, 0], [1, 1]]', unless a file by that name is there."""
    if not text.lstrip().startswith(("[", "{")):
        return False
    try:
        return len(text) > 4096 or not Path(text).exists()
    except (OSError, ValueError):  # a name too long or with NUL: not a file
        return True


def check_output_path(path: str, suffixes: tuple[str, ...], flag: str, name: str | None = None) -> Path:
    """The path as a Path, or a MaskError naming what is wrong with it.

    Given `name` (the mask's file-name form), a directory means a file named after the
    mask in it, with the first of `suffixes`.
    """
    out = Path(path)
    if not path.strip():
        raise MaskError(f"{flag} is empty: give a file name")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach Python as lone surrogates, which no write takes
        raise MaskError(f"{flag} {path!r}: the name is not valid UTF-8 (the terminal's encoding?): give a UTF-8 file name") from None
    if name is not None and state(out) == "dir":
        out = out / (name + suffixes[0])
    elif path.endswith(("/", os.sep)) and state(out) != "dir":  # meant as a folder: say it is not there
        raise MaskError(f"{flag} {path!r}: folder {path.rstrip('/' + os.sep) or path!r} does not exist; create it first, or give a file name")
    suffix = out.suffix.lower()
    if suffix not in suffixes:
        raise MaskError(
            f"{flag} {path!r}: unknown extension {suffix or '(none)'!r}; use one of {', '.join(suffixes)}"
        )
    if len(out.name.encode()) > 255 - 16:  # the temporary file beside it takes a few more characters
        raise MaskError(f"{flag} {path!r}: the file name is {len(out.name.encode())} bytes long; file systems take 255 at most: use a shorter name")
    parent = out.parent if str(out.parent) else Path(".")
    parent_state = state(parent)
    if parent_state != "dir":
        problem = "does not exist; create it first" if parent_state in ("missing", "file", "special") else f"cannot be used ({parent_state})"
        raise MaskError(f"{flag} {path!r}: directory {str(parent)!r} {problem}")
    if not os.access(parent, os.W_OK):
        raise MaskError(f"{flag} {path!r}: directory {str(parent)!r} is not writable: write somewhere else")
    found = state(out)
    if found == "dir":
        raise MaskError(f"{flag} {path!r} is a directory; give a file name")
    if found == "special":
        raise MaskError(f"{flag} {path!r} is not a regular file (a FIFO, a device or a socket): give a file name")
    try:  # as atomic_write will: /proc, a read-only mount (which modes do not show root) refuse it now, not after the work
        handle, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=parent)
    except OSError as error:
        raise MaskError(f"{flag} {path!r}: directory {str(parent)!r} is not a place files can be written "
                        f"({error.strerror or error}): write somewhere else") from None
    try:  # (a kill now must not leave the probe behind: "whole, or nothing")
        os.close(handle)
    finally:
        os.unlink(probe)
    return out


CREATED: list[Path] = []  # the files this command made where none was: fail() removes them (all or nothing)


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(temp_path) beside `path`, then rename over it: no partial file is ever left."""
    existed = os.path.lexists(path)
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    except OSError as error:
        raise MaskError(f"cannot write {str(path)!r}: {error.strerror}") from None
    os.close(handle)
    try:
        write(temp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp made it private; give it a normal file's mode
        os.replace(temp, path)
        if not existed:
            CREATED.append(path)
    except OSError as error:
        raise MaskError(f"cannot write {str(path)!r}: {error.strerror or error}") from None
    except MaskError:
        raise
    except Exception as error:  # torch.save reports a full disk as a RuntimeError
        cause = _os_error_behind(error)  # matplotlib's PDF writer hides a full disk behind an AttributeError of its own
        if cause is not None:
            raise MaskError(f"cannot write {str(path)!r}: {cause.strerror or cause}") from None
        reason = " ".join(str(error).split())[:200]
        raise MaskError(f"cannot write {str(path)!r}: {type(error).__name__}: {reason} (is the disk full?)") from None
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _os_error_behind(error: BaseException) -> OSError | None:
    """The OSError that `error` was raised while handling (or from), if any: what really went wrong."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def json_number(value: float):
    """A float for JSON: NaN and infinities as the strings "nan", "inf", "-inf" (which maskcli reads back)."""
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return value


def check_disk(path: Path, size: int, flag: str) -> None:
    """Refuse to start writing `size` bytes where the disk has less room."""
    import shutil

    from maskcli.memory import format_bytes

    usage = shutil.disk_usage(path.parent if str(path.parent) else ".")
    free = usage.free
    if usage.total == 0:  # /proc, /sys: a file system of no blocks, where no file can be written
        raise MaskError(f"{flag} {str(path)!r}: {str(path.parent)!r} is not a place files can be written (a virtual file system): write elsewhere")
    if size > free:
        raise MaskError(
            f"{flag} {str(path)!r} would write {format_bytes(size)} but the disk there has {format_bytes(free)} free: "
            "use a smaller --len, or --png for a picture of it"
        )


def write_array(array, path: Path) -> None:
    """A numpy array or torch tensor as .pt (or .pth), .npy or .json (by suffix), written whole or not at all."""
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        import torch

        tensor = torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array
        atomic_write(path, lambda temp: torch.save(tensor, temp))
    elif suffix == ".npy":
        import numpy as np

        values = array if isinstance(array, np.ndarray) else array.numpy()

        def save(temp: str) -> None:
            with open(temp, "wb") as handle:  # a handle: given a name, np.save would add ".npy" to one that ends ".NPY"
                np.save(handle, values)

        atomic_write(path, save)
    else:
        import json

        def nested(item):
            if isinstance(item, list):
                return [nested(x) for x in item]
            return json_number(item) if isinstance(item, float) else item

        atomic_write(path, lambda temp: Path(temp).write_text(json.dumps(nested(array.tolist())) + "\n"))


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
                      "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(arrays: dict, path: str) -> None:
    """numpy arrays as a .safetensors file: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte offsets (padded with spaces to 8 bytes), then the raw little-endian bytes."""
    import json
    import struct

    header, offset, parts = {}, 0, []
    for name, array in arrays.items():
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(array.dtype)], "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        parts.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for raw in parts:
            handle.write(raw)
