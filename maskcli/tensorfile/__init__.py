"""Read named tensors from .pt, .npy, .npz, .safetensors and .json files, or inline JSON.

Loading never runs code from the file: .pt goes through `torch.load(weights_only=True)`,
.npy/.npz through `numpy.load(allow_pickle=False)`, and .safetensors is parsed here
(an 8-byte header length, a JSON header, raw little-endian bytes), so no extra
dependency is needed for it.

Every file but .pt is read into numpy arrays without importing torch (`read_tensors`);
`load_tensors` is the torch view of the same reading, for code that computes with torch.
numpy has no bfloat16: such a tensor is widened to float32 (exactly: bfloat16 is float32's
top 16 bits) with the dtype BFLOAT16, whose metadata keeps the name that `dtype_name` says.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.text import names_text, shortened

from maskcli.files import SAFETENSORS_DTYPES, checked_source, is_inline  # noqa: F401 - is_inline is read from here too
from maskcli.numpyfile import SLICE_FIX, from_numpy

BFLOAT16 = np.dtype(np.float32, metadata={"name": "bfloat16"})  # a bfloat16 tensor's values, widened exactly
# the codes safetensors writes, by numpy's dtype names (files.py writes them), and bfloat16
_SAFETENSORS_DTYPES = {code: np.dtype(name) for name, code in SAFETENSORS_DTYPES.items()} | {"BF16": BFLOAT16}


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


def as_tensor(values):
    """A numpy array as a torch tensor (a BFLOAT16 one as bfloat16 again); a tensor as it is."""
    import torch

    if isinstance(values, torch.Tensor):
        return values
    tensor = torch.from_numpy(values)
    return tensor.to(torch.bfloat16) if dtype_name(values) == "bfloat16" else tensor


def load_tensors(source: str, flag: str, json_floats=None, numbers: bool = False) -> dict:
    """Every tensor in a file (or inline JSON) by name, as torch tensors; a lone tensor is named ''.

    JSON carries no dtype: its floats become `json_floats` (a torch dtype), or torch's default dtype. `numbers`:
    a .pt dict's plain ints and lists of ints are tensors too (a collator's max_length_q is a Python int).
    """
    import torch

    floats = str(json_floats or torch.get_default_dtype()).removeprefix("torch.")
    return {name: as_tensor(value) for name, value in read_tensors(source, flag, floats, numbers).items()}


def read_tensors(source: str, flag: str, json_floats: str = "float32", numbers: bool = False, lists: tuple[str, ...] = (),
                 work: tuple[float, str] = (0, "to load")) -> dict:
    """Every tensor in a file (or inline JSON) by name; a lone tensor is named ''.

    numpy arrays, read without torch, from every file but .pt, whose tensors come as torch.load gives them (the
    caller converts them at its edge). JSON's floats become `json_floats` (a numpy dtype name); `numbers`: see
    load_tensors. `lists`: the fields (of a JSON object or a .pt dict) kept as the nested lists they are (a ragged choice list).
    `work`: (bytes per cell, what for) the caller needs beyond the arrays themselves: an .npz whose headers declare
    more than memory holds is refused from its headers, before a byte of it is unpacked.
    """
    if is_inline(source):
        where = f"{flag} {shortened(source, 60)!r} (inline JSON)"
        return _read_json(source, where, json_floats, lists)
    path, where, size = checked_source(source, flag)
    suffix = path.suffix.lower()
    try:
        _check_fits(size, suffix, where)
        if suffix in (".pt", ".pth"):
            return _from_pt(path, where, numbers, lists)
        if suffix in (".npy", ".npz"):
            return from_numpy(path, where, work)
        if suffix == ".safetensors":
            return _from_safetensors(path, where)
        return _read_json(path.read_text(errors="replace"), where, json_floats, lists)
    except OSError as error:  # unreadable (permissions, a vanished file): one line, not a traceback
        raise MaskError(f"{where}: cannot read it ({error.strerror or error})") from None


JSON_BYTES_PER_CHARACTER = 16  # a JSON number of 2-3 characters becomes a Python int or float (24-32 bytes) in a list


def _check_fits(size: int, suffix: str, where: str) -> None:
    """Refuse, before reading a byte, a file whose tensors cannot fit in the memory this process has left."""
    from maskcli.memory import check_bytes_fit

    needed = size * JSON_BYTES_PER_CHARACTER if suffix == ".json" else size
    how = "to read its text into numbers" if suffix == ".json" else "to load"
    check_bytes_fit(needed, f"{where} ({size:,} bytes on disk)", how, fix=SLICE_FIX)


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


def _read_json(text: str, where: str, floats: str, lists: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A JSON tensor: a plain nested list of numbers parsed by numpy (jsonarrays), anything else through json."""
    from maskcli.jsonarrays import dense_numbers

    array = dense_numbers(text)
    if array is None:
        return _from_json(_parse_json(text, where), where, floats, lists)
    if array.dtype.kind == "f":
        with np.errstate(over="ignore"):  # as _from_json: a double past float32's range is inf there
            array = array.astype(floats)
    return {"": array}


def _parse_json(text: str, where: str):
    def integer(digits: str) -> int:  # numpy would make a wider one uint64, float64 or an object, not an error
        if len(digits.lstrip("-")) > 19:  # past int64, and int() itself refuses more than 4,300 digits
            raise MaskError(f"{where}: not a rectangular nested list of numbers ({shortened(digits, 40)} does not fit int64)")
        value = int(digits)
        if not -(1 << 63) <= value < 1 << 63:
            raise MaskError(f"{where}: not a rectangular nested list of numbers ({shortened(digits, 40)} does not fit int64)")
        return value

    # json's C scanner makes ints itself only where parse_int is int (CPython Modules/_json.c, _match_number_unicode):
    # a Python callback per number made a 4096 x 4096 file take 20 s. Only a run of 19 digits can leave int64.
    wide = _WIDE_INTEGER.search(text) is not None
    fast = None if wide else _spelled_constants(text)
    try:
        if fast is not None:
            try:
                return json.loads(fast)
            except json.JSONDecodeError:  # the spellings replaced where they were not values (a key "nan"): read as written
                pass
        return json.loads(text, parse_int=integer if wide else None)
    except json.JSONDecodeError as error:
        raise MaskError(f"{where}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    except RecursionError:
        raise MaskError(f"{where}: JSON nested too deeply to be a tensor") from None


_WIDE_INTEGER = re.compile(r"[0-9]{19}")
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# maskcli's JSON spells non-finite values as strings; json reads JavaScript's constants as floats itself
_CONSTANTS = {'"-inf"': "-Infinity", '"inf"': "Infinity", '"nan"': "NaN"}


def _spelled_constants(text: str) -> str:
    """`text` with maskcli's "nan", "inf", "-inf" strings as the constants json reads as floats (str.replace: C speed)."""
    for spelled, constant in _CONSTANTS.items():
        if spelled in text:
            text = text.replace(spelled, constant)
    return text


def _numbers(value):
    """Nested lists with maskcli's JSON spelling of non-finite values ("nan", "inf", "-inf", any case) as floats."""
    if isinstance(value, list):
        return [_numbers(item) for item in value]
    if isinstance(value, str) and value.lower() in _NON_FINITE:
        return _NON_FINITE[value.lower()]
    return value


def _from_json(data, where: str, floats: str = "float32", lists: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    items = data.items() if isinstance(data, dict) else [("", data)]
    arrays = {}
    for name, value in items:
        if name in lists:
            arrays[name] = value
            continue
        label = f" {name!r}" if name else ""
        try:
            array = np.array(value)  # C speed where the values are numbers already (_parse_json made the usual constants)
            if array.dtype.kind not in "biuf":  # other spellings ("-Inf"), text, null, objects: looked at one by one
                value = _numbers(value)
                array = np.array(value)
        except ValueError:  # numpy's "inhomogeneous shape": rows of different lengths, or a list beside a number
            raise MaskError(f"{where}{label}: not a rectangular nested list of numbers (its rows differ in length or depth)") from None
        if array.dtype.kind not in "biuf":
            raise MaskError(f"{where}{label}: not a rectangular nested list of numbers ({shortened(json.dumps(next(_not_numbers(value), None)), 40)} is not a number)")
        if array.dtype.kind == "f":
            with np.errstate(over="ignore"):  # a double past float32's range is inf there, as torch.tensor makes it
                array = array.astype(floats)
        arrays[name] = array
    return arrays


def _not_numbers(value):
    """The leaves of nested lists that are not numbers."""
    if isinstance(value, list):
        for item in value:
            yield from _not_numbers(item)
    elif not isinstance(value, (bool, int, float)):
        yield value


def _short(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def _from_pt(path: Path, where: str, numbers: bool = False, lists: tuple[str, ...] = ()) -> dict:
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error below says enough
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message is mostly advice to turn weights_only off; keep the line that names the object
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        named = [line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")]
        reason = (named or lines[1:2] or ["it holds objects other than tensors"])[0]
        raise MaskError(
            f"{where}: refused to load with weights_only=True, nothing in it was run ({reason[:200]}); "
            "save the tensor itself with torch.save(tensor, path)"
        ) from None
    except Exception as error:  # torch raises RuntimeError, EOFError, zipfile errors... for bad files
        raise MaskError(f"{where}: not a readable .pt file ({type(error).__name__}: {str(error)[:160]})") from None
    for name, value in (data.items() if isinstance(data, dict) else [("", data)]):
        if isinstance(value, torch.Tensor) and value.is_nested:  # its sizes are per item: every reader would fail on it
            label = f" entry {name!r}" if name else ""
            raise MaskError(f"{where}{label} is a nested tensor (items of different shapes); save a plain tensor "
                            f"(torch.nested.to_padded_tensor, or each item alone)")
    if isinstance(data, torch.Tensor):
        return {"": data}
    kept = {name: data.pop(name) for name in lists if isinstance(data, dict) and name in data}
    if kept and not data:
        raise MaskError(f"{where}: holds only {', '.join(kept)}, no tensors")
    if numbers and isinstance(data, dict):
        data = {k: _as_tensor(v) for k, v in data.items()}
    if isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
        return {str(k): v for k, v in data.items()} | kept
    if isinstance(data, dict) and data:
        odd = next(k for k, v in data.items() if not isinstance(v, torch.Tensor))
        raise MaskError(f"{where}: entry {odd!r} of the dict is {type(data[odd]).__name__} {_short(data[odd])}, not a tensor; save only tensors")
    raise MaskError(f"{where}: holds {type(data).__name__} {_short(data)}, not a tensor or a dict of tensors")


def _as_tensor(value):
    """A plain int or a (nested) list of ints as a tensor; anything else as it is."""
    import torch

    if isinstance(value, bool) or not isinstance(value, (int, list)):
        return value
    try:
        return torch.tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return value


def _from_safetensors(path: Path, where: str) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        if 8 + header_len > len(data):
            raise MaskError(f"{where}: not a readable .safetensors file (damaged: its header says it is {header_len:,} bytes long, but the file has {len(data):,})")
        header = json.loads(data[8 : 8 + header_len])
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
            if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                raise MaskError(f"{where}: tensor {name!r} has shape {_short(shape)}; a shape is a list of sizes of 0 or more")
            size = math.prod(shape) * (2 if dtype is BFLOAT16 else dtype.itemsize)
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= len(data) - base and end - start == size):
                raise MaskError(
                    f"{where}: tensor {name!r} has data_offsets {_short(info['data_offsets'])}, which do not hold its "
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
    except Exception as error:
        raise MaskError(f"{where}: not a readable .safetensors file ({type(error).__name__}: {str(error)[:160]})") from None
