"""What a kind is: a name and meaning, parameters, and two exact forms of the same set of cells.

    predicate(params, frame, device) -> mask_mod(b, h, q, kv) -> bool tensor   # absolute q, kv (torch)
    intervals(params, frame) -> Intervals                                      # numpy, O(L)
    why(params, frame, b, q, kv) -> (keep, reason in words)                    # one cell, plain ints (--why)

A kind module defines its kinds with `Kind(...)` in a module-level tuple `KINDS`; the
registry collects every module of this package, so adding a kind is one module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.positions import Frame

REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One parameter of a kind: how it is written, checked and explained.

    `type` is "int" (one integer), "choice" (one of `choices`) or "labels" (integers per
    position, per batch row: inline, from sizes, or from a file).
    """

    name: str
    type: str
    help: str
    flag: str
    default: Any = REQUIRED
    minimum: int | None = None
    choices: tuple[str, ...] = ()
    metavar: str = "N"
    sizes: bool = False  # a labels parameter that may also be given as segment sizes: sizes=[3,5], --sizes 3,5
    documents: bool = False  # a labels parameter that, left out, takes the expression's document labels (Kind.documents)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def check(self, value, where: str):
        """The value, validated; `where` names it in messages ('window(0)', '--window 0')."""
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise MaskError(f"{where}: {self.name} must be a whole number, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise MaskError(f"{where}: {self.name} must be at least {self.minimum}, got {value}; {self.name} = {self.help}")  # help may hold parentheses
            if abs(value) > 1 << 40:
                raise MaskError(f"{where}: {self.name} {value} is too large (at most {1 << 40:,} in size)")
            return value
        if self.type == "choice":
            if value not in self.choices:
                raise MaskError(f"{where}: {self.name} must be one of {', '.join(self.choices)}, got {value!r}")
            return value
        if self.type == "labels":
            return value  # Labels are checked where they are made
        raise ValueError(f"unknown parameter type {self.type!r}")


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


MaskMod = Callable[..., Any]


@dataclass(frozen=True)
class Profile:
    """What recognition reads off one (Lq, Lk) keep matrix, in absolute positions (numpy)."""

    q: np.ndarray  # absolute query positions (Lq,)
    first: np.ndarray  # first visible key per row (k_end where none)
    last: np.ndarray  # last visible key per row (k_start - 1 where none)
    seen: np.ndarray  # bool (Lq,): the row sees some key
    k_start: int
    k_end: int
    marked: str  # what the tensor's True/1 cells mean: "attend" or "masked" (tril vs triu)


@dataclass(frozen=True)
class Kind:
    """One kind of mask, defined once: everything that lists, explains or builds it reads this."""

    name: str
    meaning: str  # one line, for help text and `maskcli kinds`
    keep: str  # the definition on absolute positions, e.g. "q - W < kv <= q"
    params: tuple[Param, ...]
    example: str  # an expression that shows it, e.g. "window(3)"
    intervals: Callable[[dict, Frame], Intervals]
    predicate: Callable[[dict, Frame, Any], MaskMod]
    rank: int  # order in lists, help and recognition: simplest first
    recognise: Callable[[Profile], Iterable[dict]] | None = None  # candidate parameters, each then rebuilt and compared
    check: Callable[[dict, Frame, str], None] | None = None  # checks that need the positions
    sequence: Callable[[dict], int | None] | None = None  # the sequence length its parameters fix
    queries: Callable[[dict], int | None] | None = None  # the number of queries its parameters fix
    causal: bool = False  # no query sees a later key, whatever the parameters
    # every query sees its own position / position 0 where they are keys and no padding cuts them, whatever the
    # parameters: recognition rules the kind out of a tensor with a row that does not, before making its intervals
    sees_own: bool = False
    sees_first: bool = False
    options: str = ""  # extra command-line options in the example (`--len 8`)
    aliases: tuple[str, ...] = field(default=())
    frame_data: bool = False  # reads the frame's batch data (padding), not only positions
    per_head: bool = False  # may differ from head to head (a user's mask_mod reads h); built-in kinds do not
    documents: bool = False  # its labels mark documents (document, segment): what a Param.documents takes
    # exact visible keys per query row without intervals or cells, for a kind whose intervals may not be few:
    # counts(params, frame, key_valid or None) -> an object with keys_below(b, ascending positions) (kinds/labels.py)
    counts: Callable[[dict, Frame, Any], Any] | None = None
    # one cell in words: why(params, frame, b, q, kv) -> (keep, "400 - 300 = 100 < 128"), on absolute positions,
    # without intervals or cells of the whole mask (None: a user's mask_mod, whose predicate is asked instead)
    why: Callable[[dict, Frame, int, int, int], tuple[bool, str]] | None = None

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def signature(self) -> str:
        """window(W), tril(D, means=keep), chunk(labels)."""
        if not self.params:
            return self.name
        parts = [p.metavar if i == 0 else f"{p.name}={p.metavar}" for i, p in enumerate(self.params)]
        return f"{self.name}({', '.join(parts)})"


def row_of(table: np.ndarray, b: int) -> np.ndarray:
    """Batch row b of a (R, n) table that has one row per batch row, or one row for all."""
    return table[b if table.shape[0] > 1 else 0]
