"""Regions: a view of part of a mask (--rows A:B, --keys C:D), over absolute positions."""

from __future__ import annotations

import numbers

from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.positions import Frame
from maskcli.text import shortened


def region_intervals(found: Intervals, whole: Frame, view: Frame) -> Intervals:
    """The intervals of the whole mask, on the rows and keys of a region of it."""
    starts, ends = found.starts, found.ends
    if starts.shape[1] > 1:
        lo, hi = view.q_start - whole.q_start, view.q_end - whole.q_start
        starts, ends = starts[:, lo:hi], ends[:, lo:hi]
    return Intervals.of(starts, ends, view.k_start, view.k_end)


def bounds(given: tuple[int | None, int | None], low: int, high: int, flag: str, what: str) -> tuple[int, int]:
    if len(given) != 2 or any(end is not None and (isinstance(end, bool) or not isinstance(end, numbers.Integral)) for end in given):
        raise MaskError(f"{flag} {shortened(repr(given), 40)}: give (A, B), whole numbers or None for an open side")
    start = low if given[0] is None else given[0]
    end = high if given[1] is None else given[1]
    if not low <= start < end <= high:
        shown = f"{'' if given[0] is None else given[0]}:{'' if given[1] is None else given[1]}"
        further = " (--len, --offset and --kv-len say how far the mask reaches)" if max(start, end) > high else ""
        raise MaskError(f"{flag} {shown} is outside the {what} {low}-{high - 1} of this mask (or empty): give A:B with "
                        f"{low} <= A < B <= {high}, either side left open{further}")
    return start, end


def parse_region(text: str | None, flag: str) -> tuple[int | None, int | None]:
    """'A:B', 'A:' or ':B' -> (A, B) with None for an open side (absolute positions)."""
    if text is None:
        return (None, None)
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(int(part) if part.strip() else None for part in parts)  # type: ignore[return-value]
    except ValueError:
        raise MaskError(f"{flag} {shortened(text, 40)!r} is not a range: give A:B (absolute positions, B not included), like 200:216, 4000: or :64") from None


def checked_options(options) -> None:
    """MaskOptions' whole-number fields as ints (offset=1.5 made keys 0-4.5, heads=nan a shape of nan), and rows /
    keys given as (A, B) tuples written as the command line's 'A:B'."""
    import operator

    for name in ("length", "offset", "kv_start", "kv_len", "heads", "pad_id"):
        value = getattr(options, name)
        if value is None or type(value) is int:
            continue
        try:
            if isinstance(value, (bool, str)):
                raise TypeError
            object.__setattr__(options, name, operator.index(value))  # a numpy integer, a 0-d integer tensor
        except TypeError:
            raise MaskError(f"{name}={shortened(repr(value), 60)} is a {type(value).__name__}; {name} is a whole number "
                            "(an int)") from None
    for name in ("rows", "keys"):
        value = getattr(options, name)
        if isinstance(value, (tuple, list)):
            if len(value) != 2 or not all(end is None or (isinstance(end, numbers.Integral) and not isinstance(end, bool))
                                          for end in value):
                raise MaskError(f"{name}={shortened(repr(value), 60)}: give (A, B), whole numbers or None for an open side "
                                "(absolute positions, B not included), or the text 'A:B'")
            object.__setattr__(options, name, ":".join("" if end is None else str(int(end)) for end in value))


def checked_cells(b, h, q_lo, q_hi, q_len: int) -> int:
    """Mask.cells' q_hi (None: q_len), its arguments checked: whole numbers, a batch row and head of 0 or more (one past
    the mask's own is one it broadcasts to, as diff asks of a mask with fewer heads), 0 <= q_lo <= q_hi <= q_len."""
    q_hi = q_len if q_hi is None else q_hi
    whole = all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (b, h, q_lo, q_hi))
    if not (whole and b >= 0 and h >= 0 and 0 <= q_lo <= q_hi <= q_len):
        raise MaskError(f"cells(b={b!r}, h={h!r}, q_lo={q_lo!r}, q_hi={q_hi!r}): give whole numbers, a batch row and head of "
                        f"0 or more and local query rows 0 <= q_lo <= q_hi <= {q_len}")
    return q_hi
