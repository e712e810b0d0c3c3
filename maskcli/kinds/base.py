"""What a kind is: a name and meaning, parameters, and two exact forms of the same set of cells.

    predicate(params, frame, device) -> mask_mod(b, h, q, kv) -> bool tensor   # absolute q, kv (torch)
    intervals(params, frame) -> Intervals, or its bounds (starts, ends)       # numpy, O(L)
    why(params, frame, b, q, kv) -> (keep, reason in words)                    # one cell, plain ints (--why)

A kind module defines its kinds with `Kind(...)` in a module-level tuple `KINDS`; the
registry collects every module of this package, so adding a kind is one module.

A kind whose keys are one interval per row (or a few, each a column of K) returns its bounds, `(starts, ends)`
broadcast to (B, Lq, K) on absolute key positions, unsorted, overlapping or out of the keys as they come: whoever
asks (`terms`, `recognised`) makes them Intervals (`Intervals.of` on the frame's keys), so a reading that makes every
candidate's makes them together. A kind whose set needs the algebra (labels, a draft tree) returns Intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.kinds.values import Labels, row_of  # noqa: F401  (where the kinds and their users import them)
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
    intervals: Callable[[dict, Frame], Intervals | tuple]  # Intervals, or bounds (starts, ends) Intervals.of normalises
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


NOT_MADE = object()  # a candidate whose intervals `recognised` was not asked to make


def recognised(kinds, asks, max_labels: int) -> list[tuple]:
    """Every kind's candidates read off one reading's profile, bound and placed in one call: recognition's, per
    reading. `asks`: per placement, (its order, the profile with its queries there, the facts the tensor lacks there
    (a kind that declares one is not asked: Kind.causal, sees_own, sees_first), the Frame to make the candidates'
    intervals on (None: none made), and the facts that rule a candidate out of being made there). The kinds are
    asked module by module (each kind module entered once), and each candidate's values checked as typed ones are
    (Param.check) and its intervals made as terms.placed_each makes one term's (its draft tree's queries, its labels'
    sequence and its own check first: a MaskError where placed refuses it, None where its intervals are not few).
    Returns (kind, its checked (name, value) pairs or None where a value is refused, placement order, its intervals,
    a MaskError, None, or NOT_MADE), simplest kind first, then by placement; labels longer than `max_labels` are no
    candidate."""
    from maskcli.intervals import NotFew

    for _, _, _, frame, _ in asks:  # positions read once per frame here, before any kind reads them
        if frame is not None:
            frame.q_column, frame.k_end, frame.n  # noqa: B018 (cached on the frame)
    by_module: dict[str, list[Kind]] = {}
    for kind in kinds:
        if kind.recognise is not None:
            by_module.setdefault(kind.recognise.__module__, []).append(kind)
    found = []  # (rank, order, name, index, kind, checked, made)
    for module_kinds in by_module.values():
        for kind in module_kinds:
            for order, seen, lacks, frame, rules_out in asks:
                if any(getattr(kind, fact) for fact in lacks):
                    continue
                for index, values in enumerate(list(kind.recognise(seen))):
                    if any(isinstance(v, Labels) and v.shape[1] > max_labels for v in values.values()):
                        continue
                    try:
                        checked = tuple((p.name, p.check(values.get(p.name, p.default), kind.name)) for p in kind.params)
                    except MaskError:
                        found.append((kind.rank, order, kind.name, index, kind, None, NOT_MADE))
                        continue
                    made = NOT_MADE
                    if frame is not None and not any(getattr(kind, fact) for fact in rules_out):
                        made_values = dict(checked)  # as terms.placed_each makes one term's (inline: the kind's
                        try:  # module is entered once by this frame, not once per candidate)
                            fixed = kind.queries(made_values) if kind.queries is not None else frame.q_len
                            if fixed != frame.q_len:
                                raise MaskError(f"--len {frame.q_len} does not match the {fixed} draft tokens of the tree")
                            count = kind.sequence(made_values) if kind.sequence is not None else None
                            if count is not None and count != frame.n:
                                raise MaskError(f"the labels of {kind.name} have {count} entries, the mask {frame.n} positions")
                            if kind.check is not None:
                                kind.check(made_values, frame, kind.name)
                            made = kind.intervals(made_values, frame)  # bounds made Intervals below, together
                        except MaskError as error:
                            made = error
                        except NotFew:
                            made = None
                    found.append((kind.rank, order, kind.name, index, kind, checked, made))
    found.sort(key=lambda item: item[:4])
    ends = {order: (frame.k_start, frame.k_end) for order, _, _, frame, _ in asks if frame is not None}
    return [(kind, checked, order, Intervals.of(*made, *ends[order]) if isinstance(made, tuple) else made)
            for _, order, _, _, kind, checked, made in found]  # every kind's bounds normalised in one run of calls

