"""Regions: a view of part of a mask (--rows A:B, --keys C:D), over absolute positions."""

from __future__ import annotations

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
