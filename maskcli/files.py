"""Output paths: checked before any work is done, written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from maskcli.errors import MaskError

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
TENSOR_SUFFIXES = (".pt", ".npy")


def check_output_path(path: str, suffixes: tuple[str, ...], flag: str) -> Path:
    """The path as a Path, or a MaskError naming what is wrong with it."""
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in suffixes:
        raise MaskError(
            f"{flag} {path!r}: unknown extension {suffix or '(none)'!r}; use one of {', '.join(suffixes)}"
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MaskError(f"{flag} {path!r}: directory {str(parent)!r} does not exist; create it first")
    if out.is_dir():
        raise MaskError(f"{flag} {path!r} is a directory; give a file name")
    return out


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(temp_path) beside `path`, then rename over it: no partial file is ever left."""
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
    except OSError as error:
        raise MaskError(f"cannot write {str(path)!r}: {error.strerror or error}") from None
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
