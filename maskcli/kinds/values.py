"""Integer lists as kinds take them: inline (`0,0,1,1`, `;` between batch rows), from segment sizes, or from a file;
and the Labels they make, and a table's row per batch row (`row_of`).

Only numpy is needed, except for .pt files (torch.load with weights_only=True). Labels and row_of live here, below
kinds/base.py (which imports them for the kinds), not in base: the kinds make and read them while base's
`recognised` asks the kinds for candidates, and a kind calling into base there would climb back into the module
asking it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.text import shortened

FILE_SUFFIXES = (".npy", ".json", ".txt", ".pt")
_INT = re.compile(r"^\s*[+-]?[0-9]+\s*$")
_NOT_DIGITS = re.compile(r"[^\s0-9,+-]")
INT64_LIMIT = 1 << 62  # labels and ids stay far from int64's edge, so differences and sums cannot wrap


@dataclass(frozen=True, eq=False)
class Labels:
    """Integer labels per absolute position, one row or one per batch row, and how they were written.

    `made` is the array, or what makes it on first use of `array`: labels from segment sizes
    are two numbers until a view needs them, so the mask's memory guards, which read only the
    shape, refuse `document(sizes=[1000000000])` before 8 GB of labels exist.
    """

    made: np.ndarray | Callable[[], np.ndarray]  # int64 (R, n), or a function that returns it
    form: str  # "inline", "sizes" or "file"
    text: str  # as it prints inside the call: 0,0,1,1 / sizes=[3,5] / "labels.npy"
    shape: tuple[int, int] | None = None  # (R, n); read off the array where not given
    rows: int = field(init=False)  # R, and n: plain values, read by every candidate a kind makes of them
    length: int = field(init=False)

    def __post_init__(self):
        if self.shape is None:
            object.__setattr__(self, "shape", tuple(self.made.shape))
        object.__setattr__(self, "rows", self.shape[0])
        object.__setattr__(self, "length", self.shape[1])
        if not callable(self.made):
            self.__dict__["array"] = self.made  # (what `array` would return: no call to make it)

    @functools.cached_property
    def array(self) -> np.ndarray:
        return self.made() if callable(self.made) else self.made

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Labels) and (self.form, self.text, self.shape) == (other.form, other.text, other.shape)
            and bool(np.array_equal(self.array, other.array))
        )

    def __hash__(self) -> int:
        return hash((self.form, self.text))

    def as_json(self):
        rows = self.array.tolist()
        return rows[0] if len(rows) == 1 else rows


def row_of(table: np.ndarray, b: int) -> np.ndarray:
    """Batch row b of a (R, n) table that has one row per batch row, or one row for all."""
    return table[b if table.shape[0] > 1 else 0]


def rows_text(rows) -> str:
    """((0, 0, 1), (0, 1, 1)) -> '0,0,1;0,1,1'."""
    return ";".join(",".join(map(str, np.asarray(row).tolist())) for row in rows)


def _same_widths(rows, where: str) -> list[int]:
    """The rows' lengths, all one: a batch row per row, one value per position each."""
    widths = [len(row) for row in rows]
    if len(set(widths)) > 1:
        raise MaskError(f"{where}: the batch rows have {', '.join(map(str, widths))} values, in that order: give every batch row one value per position")
    return widths


def _array(rows, where: str) -> np.ndarray:
    widths = _same_widths(rows, where)
    if set(widths) == {0}:
        raise MaskError(f"{where}: no values: give comma-separated integers such as 0,0,1,1")
    try:
        array = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)
    except OverflowError:
        array = None
    if array is None or np.abs(array).max() > INT64_LIMIT:
        raise MaskError(f"{where}: a value is too large for a label (at most ±{INT64_LIMIT:,})")
    return array


def inline(rows, where: str) -> Labels:
    """Labels written out: rows of integers."""
    return Labels(_array(rows, where), "inline", rows_text(rows))


def from_sizes(rows, where: str) -> Labels:
    """Labels 0,0,0,1,1 from sizes [3, 2]: one segment per size, per batch row (rows may hold different counts)."""
    sizes = []
    for row in rows:
        try:
            row = np.asarray(row, dtype=np.int64)
        except OverflowError:
            raise MaskError(f"{where}: a segment size is too large (at most {INT64_LIMIT:,})") from None
        if row.size == 0:
            raise MaskError(f"{where}: a batch row has no sizes: give sizes like 3,5")
        if row.min() < 1 or row.max() > INT64_LIMIT:
            bad = int(row[(row < 1) | (row > INT64_LIMIT)][0])
            raise MaskError(f"{where}: segment sizes must be at least 1, got {bad}")
        sizes.append(row)
    totals = sorted({int(row.sum()) for row in sizes})
    if len(totals) > 1:
        raise MaskError(f"{where}: the batch rows' sizes add up to different lengths {totals}: every row must cover the same positions")
    from maskcli.memory import check_dense_fits

    check_dense_fits((len(sizes), totals[0]), 8, "", fix="use fewer or smaller sizes", what="labels")

    def labels() -> np.ndarray:  # on first use: the mask's guards read the shape first (see Labels)
        return np.stack([np.repeat(np.arange(len(row), dtype=np.int64), row) for row in sizes])

    return Labels(labels, "sizes", "sizes=[" + rows_text(rows) + "]", shape=(len(sizes), totals[0]))


def parse_rows(text: str, where: str, example: str = "0,0,1,1") -> list[np.ndarray]:
    """'0,0,1;0,1,1' -> [array([0, 0, 1]), array([0, 1, 1])], quoting the bad item.

    numpy converts a whole row at once; only a row that fails is looked at item by item.
    """
    if all(not item.strip() for item in re.split(r"[,;]", text)):
        raise MaskError(f"{where}: no values: give comma-separated integers such as {example}")
    rows = []
    for number, row_text in enumerate(text.split(";")):
        if not row_text.strip():
            raise MaskError(f"{where}: batch row {number} of {text[:80]!r} is empty: give every row one value per position, ';' between rows")
        items = row_text.split(",")
        try:
            if _NOT_DIGITS.search(row_text):  # numpy reads '1_0' as 10 and '１' as 1: digits 0-9 only, as --len takes
                raise ValueError(row_text)
            rows.append(np.array(items, dtype=np.int64))
            continue
        except OverflowError:
            raise MaskError(f"{where}: a value in {text[:80]!r} is too large (at most ±{INT64_LIMIT:,})") from None
        except ValueError:
            pass
        long = next((item for item in items if _INT.match(item) and len(item.strip().lstrip("+-")) > 19), None)
        if long is not None:  # past int64 (and past Python's 4,300-digit limit on converting text)
            shown = long.strip() if len(long.strip()) <= 40 else long.strip()[:20] + "..." + long.strip()[-8:]
            raise MaskError(f"{where}: {shown!r} is too large (at most ±{INT64_LIMIT:,})")
        position, item = next((i, item) for i, item in enumerate(items) if not _INT.match(item))
        offset = sum(len(r.split(",")) for r in text.split(";")[:number])
        shown = item.strip() or "(nothing)"
        raise MaskError(f"{where}: {shown!r} at position {offset + position} of {text!r} is not an integer (write them like {example})")
    return rows


def from_flag(text: str, flag: str, sizes: bool = False) -> Labels:
    """A flag's value: inline integers, or a file path (by its suffix)."""
    where = f"{flag} {text!r}"
    if is_file_value(text):
        labels = from_file(text, where)
        return _sizes_of(labels, where) if sizes else labels
    rows = parse_rows(text, where, "3,5" if sizes else "0,0,1,1")
    return from_sizes(rows, where) if sizes else inline(rows, where)


def is_file_value(text: str) -> bool:
    """A flag's value that names a labels file (by its suffix), not inline integers."""
    return Path(text).suffix.lower() in FILE_SUFFIXES and not _looks_inline(text)


def _looks_inline(text: str) -> bool:
    return bool(re.fullmatch(r"[\s0-9,;+-]*", text))


def _sizes_of(labels: Labels, where: str) -> Labels:
    return from_sizes(labels.array.tolist(), where)


def from_file(path: str, where: str) -> Labels:
    """Labels from .npy, .json, .txt (integers separated by commas or spaces, a line per batch row) or .pt."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise MaskError(f"{where}: unknown file type {suffix or '(none)'!r}; labels are read from {', '.join(FILE_SUFFIXES)}")
    from maskcli.files import readable_file, state

    if state(file) == "missing":
        raise MaskError(f"{where}: no such file {path!r}")
    readable_file(path, f"{where}: {path!r}")
    if file.stat().st_size == 0:
        raise MaskError(f"{where}: the file is empty: give labels, one integer per position")
    try:
        if suffix == ".npy":
            array = np.load(file, allow_pickle=False)
        elif suffix == ".json":
            data = json.loads(file.read_text())
            if isinstance(data, list) and data and all(isinstance(row, list) for row in data):
                _same_widths(data, where)  # (numpy's own word for it: "an inhomogeneous shape after 1 dimensions")
            array = np.asarray(data)
        elif suffix == ".txt":
            # a line per batch row, or ';' between rows as inline labels write them
            lines = [line for line in re.split(r"[\n;]", file.read_text()) if line.strip()]
            rows = [re.split(r"[\s,]+", line.strip()) for line in lines]
            bad = next((item for row in rows for item in row if not re.fullmatch(r"[+-]?[0-9]+", item)), None)
            if bad is not None:
                raise MaskError(f"{where}: {shortened(bad, 40)!r} is not an integer: write integers separated by commas or spaces, a line (or ';') per batch row")
            if any(len(item.lstrip("+-")) > 19 for row in rows for item in row):
                raise MaskError(f"{where}: a label is too large (at most ±{INT64_LIMIT:,})")
            _same_widths(rows, where)
            array = np.asarray([np.array(row, dtype=np.int64) for row in rows])
        else:  # through the house loader: weights_only, pickled code refused in one line, no torch warnings
            from maskcli.tensorfile import load_tensors

            try:
                tensors = load_tensors(path, "\0")
            except MaskError as error:  # it names the file as FLAG 'path': say `where` instead
                raise MaskError(str(error).replace(f"\0 {path!r}", where)) from None
            if len(tensors) != 1:
                raise MaskError(f"{where}: the .pt file holds {len(tensors)} tensors; save one tensor of labels")
            array = next(iter(tensors.values())).numpy()
    except MaskError:
        raise
    except OverflowError:
        raise MaskError(f"{where}: a label is too large (at most ±{INT64_LIMIT:,})") from None
    except (OSError, ValueError, TypeError, json.JSONDecodeError, RuntimeError, EOFError) as error:
        raise MaskError(f"{where}: cannot read labels from it ({' '.join(str(error).split())[:160]})") from None
    return Labels(checked(array, where), "file", json.dumps(path))


def checked(array: np.ndarray, where: str) -> np.ndarray:
    """Integer labels as a contiguous int64 (R, n) array: one row, or one per batch row."""
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.size == 0:
        raise MaskError(f"{where}: labels must be one row of integers, or one row per batch row; got shape {list(array.shape)}")
    if array.dtype.kind == "b":  # a mask file given for labels: its True/False would be read as labels 1/0
        raise MaskError(f"{where}: holds True/False (a bool {list(array.shape)} tensor: a mask, not labels?): give integer labels, one per position")
    if array.dtype.kind not in "iu":
        if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
            if np.abs(array).max() > INT64_LIMIT:  # checked before the cast, which would wrap it (1e300 -> -2^63)
                raise MaskError(f"{where}: a label is too large ({float(array.flat[int(np.argmax(np.abs(array)))]):g}; at most ±{INT64_LIMIT:,})")
            array = array.astype(np.int64)
        elif array.dtype.kind == "f":  # (quote the first value that is no whole number: the fix is in the file)
            bad = array.flat[int(np.argmax(~np.isfinite(array) | (array != np.round(array))))]
            raise MaskError(f"{where}: labels must be whole numbers, one per position; got {array.dtype} values such as "
                            f"{bad}: save integer labels (or token ids)")
        else:
            raise MaskError(f"{where}: labels must be integers, got {array.dtype}")
    if array.dtype.kind == "u" and array.max() > INT64_LIMIT:  # uint64 past int64 would wrap to negative labels
        raise MaskError(f"{where}: a label is too large (at most ±{INT64_LIMIT:,})")
    array = array.astype(np.int64)
    if np.abs(array).max() > INT64_LIMIT:
        raise MaskError(f"{where}: a label is too large (at most ±{INT64_LIMIT:,})")
    return np.ascontiguousarray(array)


def as_array(value, where: str) -> np.ndarray:
    """A Python value -- a list (a list of rows), a numpy array or a torch tensor on any device -- as int64 (R, n)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, read without importing torch here
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        array = None
    if array is not None and (array.dtype.kind == "b" or (isinstance(value, (list, tuple)) and _holds_bool(value))):
        raise MaskError(f"{where}: {shortened(repr(value), 60)} holds True/False: give integers (a bool is no count or "
                        "label)")
    if array is None or array.dtype == object or array.dtype.kind not in "iubf":
        raise MaskError(f"{where}: give integers, as a list, a list of rows (one per batch row, all as long), "
                        f"a numpy array or a tensor; got {shortened(repr(value), 60)}")
    return checked(array, where)


def _holds_bool(value) -> bool:
    """A bool anywhere in nested lists: numpy reads [True, 3] as [1, 3]."""
    return any(isinstance(item, bool) or (isinstance(item, (list, tuple)) and _holds_bool(item)) for item in value)


def from_python(value, where: str, sizes: bool = False) -> Labels:
    """Labels from a Python value (see as_array); `sizes`: segment sizes, whose rows may hold different counts."""
    if sizes:
        nested = isinstance(value, (list, tuple)) and value and not np.isscalar(value[0])
        return from_sizes([as_array(row, where)[0] for row in value] if nested else as_array(value, where).tolist(), where)
    array = as_array(value, where)
    return Labels(array, "inline", rows_text(array))
