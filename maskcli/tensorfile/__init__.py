"""Read named tensors from tensor files (.pt, .npy, .npz, .safetensors, .json) or inline JSON: one module of this
package per file type, found by its suffix.

Each file type is a module with a `FILE_TYPE` (base.py): its name, its suffixes, its `read`. A new one is added to
MODULES; `read_tensors` refuses a file whose type none reads, or whose bytes cannot fit in memory once read, before
reading it, and hands it to its type. Loading never runs code from the file: .pt goes through
`torch.load(weights_only=True)` (pt.py), .npy/.npz through `numpy.load(allow_pickle=False)` (npy.py), and
.safetensors is parsed here (safetensors.py), so no extra dependency is needed for it.

Every file but .pt is read into numpy arrays without importing torch (`read_tensors`); `load_tensors` is the torch
view of the same reading, for code that computes with torch. numpy has no bfloat16: such a tensor is widened to
float32 (exactly) with the dtype BFLOAT16, whose metadata keeps the name that `dtype_name` says.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.files import is_inline, readable_file, state  # noqa: F401 - is_inline is read from here too
from maskcli.tensorfile.base import BFLOAT16, SLICE_FIX, FileType, Lazy, Reading
from maskcli.text import names_text, shortened

MODULES = ("pt", "npy", "safetensors", "jsontext")  # the file types, one module each


def _by_suffix() -> dict[str, FileType]:
    """Every file type by each suffix it reads; a suffix claimed twice is a bug in maskcli."""
    found: dict[str, FileType] = {}
    for name in MODULES:
        file_type = importlib.import_module(f"maskcli.tensorfile.{name}").FILE_TYPE
        for suffix in file_type.suffixes:
            if suffix in found:
                raise RuntimeError(f"{suffix} is read by both {found[suffix].name} and {file_type.name}")
            found[suffix] = file_type
    return found


FILE_TYPES = _by_suffix()
READ_SUFFIXES = tuple(FILE_TYPES)  # tensor files maskcli reads


def dtype_name(values) -> str:
    """The dtype as torch names it (bool, int64, bfloat16, ...), of a numpy array (a widened bfloat16 one too) or a tensor."""
    if isinstance(values, np.ndarray):
        return (values.dtype.metadata or {}).get("name", values.dtype.name)
    return str(values.dtype).removeprefix("torch.")


def as_array(values) -> np.ndarray:
    """A numpy array as it is; a torch tensor (a .pt file's) as a numpy array on the host, bfloat16 widened to BFLOAT16."""
    if isinstance(values, np.ndarray):
        return values
    values = values.detach().cpu()
    if dtype_name(values) == "bfloat16":
        return values.float().numpy().view(BFLOAT16)
    return values.numpy()


def without_plain_values(tensor) -> str | None:
    """What a torch tensor is where it holds no plain values to read (a meta, quantized, sparse or nested tensor),
    in words; None for a dense one."""
    if tensor.device.type == "meta":
        return "a meta tensor (a shape, no values)"
    if tensor.is_quantized:
        return f"a quantized tensor ({str(tensor.dtype).removeprefix('torch.')})"
    if getattr(tensor, "is_nested", False):
        return "a nested tensor"
    layout = str(tensor.layout).removeprefix("torch.")
    return None if layout == "strided" else f"a {layout} tensor"


def as_tensor(values):
    """A numpy array as a torch tensor (a BFLOAT16 one as bfloat16 again); a tensor as it is."""
    import torch

    if isinstance(values, torch.Tensor):
        return values
    tensor = torch.from_numpy(values)
    return tensor.to(torch.bfloat16) if dtype_name(values) == "bfloat16" else tensor


def load_tensors(source: str, flag: str, json_floats=None, numbers: bool = False, work: tuple[float, str] = (0, "to load")) -> dict:
    """Every tensor in a file (or inline JSON) by name, as torch tensors; a lone tensor is named ''.

    JSON carries no dtype: its floats become `json_floats` (a torch dtype), or torch's default dtype. `numbers`:
    a .pt dict's plain ints and lists of ints are tensors too (a collator's max_length_q is a Python int). `work`: as
    read_tensors's.
    """
    import torch

    floats = str(json_floats or torch.get_default_dtype()).removeprefix("torch.")
    arrays = read_tensors(source, flag, floats, numbers, work=work)
    if isinstance(arrays, dict):
        return {name: as_tensor(value) for name, value in arrays.items()}
    return Lazy(arrays, lambda name: as_tensor(arrays[name]))  # an .npz's members, each unpacked when asked for


def read_tensors(source: str, flag: str, json_floats: str = "float32", numbers: bool = False, lists: tuple[str, ...] = (),
                 work: tuple[float, str] = (0, "to load")) -> dict:
    """Every tensor in a file (or inline JSON) by name; a lone tensor is named ''.

    numpy arrays, read without torch, from every file but .pt, whose tensors come as torch.load gives them (the
    caller converts them at its edge). JSON's floats become `json_floats` (a numpy dtype name); `numbers`: see
    load_tensors. `lists`: the fields (of a JSON object or a .pt dict) kept as the nested lists they are (a ragged choice list).
    `work`: (bytes per cell, what for) the caller needs beyond the arrays themselves: an .npz whose headers declare
    more than memory holds is refused from its headers, before a byte of it is unpacked.
    """
    from maskcli.memory import check_bytes_fit
    from maskcli.tensorfile import jsontext

    reading = Reading(json_floats, numbers, lists, work)
    if is_inline(source):
        return jsontext.parse(source, f"{flag} {shortened(source, 60)!r} (inline JSON)", json_floats, lists)
    path, where, size = checked_source(source, flag)
    file_type = FILE_TYPES[path.suffix.lower()]
    try:
        # refused before a byte is read where its tensors cannot fit in the memory this process has left
        check_bytes_fit(size * file_type.bytes_per_byte, f"{where} ({size:,} bytes on disk)", file_type.how, fix=SLICE_FIX)
        return file_type.read(path, where, reading)
    except OSError as error:  # unreadable (permissions, a vanished file): one line, not a traceback
        raise MaskError(f"{where}: cannot read it ({error.strerror or error})") from None


def checked_source(source: str, flag: str) -> tuple[Path, str, int]:
    """(path, its name for messages, its size) of a tensor file that exists, is readable, has a suffix a file type
    reads and is not empty; a MaskError otherwise. Without torch, so that these refusals are quick."""
    path = Path(source)
    where = f"{flag} {source!r}"
    suffix = path.suffix.lower()
    if state(path) == "missing":
        unknown = f", and {suffix!r} is not a file type maskcli reads" if suffix and suffix not in READ_SUFFIXES else ""
        like = '{"position_ids": [[0, 1, 0, 1]]}' if flag == "BATCH" else "[[1, 0], [1, 1]]"  # (pack's batch of fields)
        raise MaskError(f"{where}: no such file{unknown} (give a {', '.join(READ_SUFFIXES)} file, or inline JSON like '{like}')")
    readable_file(source, where)
    if suffix not in READ_SUFFIXES:
        raise MaskError(f"{where}: unknown file type {suffix or '(none)'!r}; use one of {', '.join(READ_SUFFIXES)} or inline JSON")
    try:
        size = path.stat().st_size
    except OSError as error:
        raise MaskError(f"{where}: cannot read it ({error.strerror or error})") from None
    if size == 0:
        raise MaskError(f"{where}: the file is empty")
    return path, where, size


def load_tensor(source: str, flag: str, names: tuple[str, ...] = (), others: tuple[str, ...] = (), json_floats=None):
    """The first of `names` that `source` holds, else its one tensor, unless that one is named in `others`."""
    tensors = load_tensors(source, flag, json_floats)
    for name in names:
        if name in tensors:
            return tensors[name]
    if len(tensors) == 1 and not set(tensors) & set(others):
        return next(iter(tensors.values()))
    held = names_text(tensors) or "no tensors"
    if not names:
        raise MaskError(f"{flag} {source!r} holds {held}; expected one tensor (choose one with --key)")
    wanted = " or ".join(repr(n) for n in names)
    if len(tensors) == 1:  # alone, but named for another input
        raise MaskError(f"{flag} {source!r} holds only {held}, another input's name; expected {wanted}: save it under that name")
    raise MaskError(f"{flag} {source!r} holds {held}; expected {wanted}: save the tensor under that name, or alone in the file")
