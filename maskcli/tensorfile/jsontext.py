"""A .json file, or inline JSON given in place of a file name: a nested list of numbers (one tensor, named ''), or
an object of them by name. maskcli writes non-finite values as the strings "nan", "inf" and "-inf"; they are read
back as numbers. JSON carries no dtype: integers are int64, floats the dtype the caller asks (`Reading.floats`).

A plain nested list of numbers is parsed by numpy (jsonarrays.py: a 4096 x 4096 mask in about a second); anything
else goes through json, which words the error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.tensorfile.base import FileType, Reading
from maskcli.text import shortened

BYTES_PER_CHARACTER = 16  # a JSON number of 2-3 characters becomes a Python int or float (24-32 bytes) in a list


def read(path: Path, where: str, reading: Reading = Reading()) -> dict[str, np.ndarray]:
    """Every tensor in a .json file by name, as numpy arrays."""
    # utf-8-sig: a byte-order mark (Windows editors write one) is read past, as the JSON after it is valid
    return parse(path.read_text(encoding="utf-8-sig", errors="replace"), where, reading.floats, reading.lists)


def parse(text: str, where: str, floats: str = "float32", lists: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
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


FILE_TYPE = FileType("json", (".json",), read, BYTES_PER_CHARACTER, "to read its text into numbers")
