"""A shifted-window block that rolls its map by another shift than the one it states, before cutting windows.

Swin and its ports (Pangu / FengWu's earth-specific blocks, Uformer, Video Swin) roll the (H, W) map by -shift_size
and cut it into windows; the block's window mask is cut for that shift (its regions end at -window and -shift along
each axis), so which tokens share a region is fixed by shift_size. A block that states shift_size (an int, or one per
axis: two, or three as Pangu's pressure level, latitude and longitude) and rolls its map along an axis by an amount
that is neither -shift nor +shift of that axis (modulo its length) puts other tokens together than the ones its mask was cut for: the mask no longer marks the regions
(NVIDIA/physicsnemo#1492: FengWu's block rolled longitude by shift_lat, not shift_lon, its mask built for shift_lon).
trace/swinroll.py reads the roll off the two tensors the block's forward holds (the map and the map rolled). Quiet
where the roll is the stated shift along every axis, either way round, or where no single roll is found.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _off(roll: int, shift: int, size: int) -> bool:
    """The roll along an axis is neither -shift nor +shift modulo the axis' length."""
    return roll % size not in ((-shift) % size, shift % size)


def rolled_otherwise(run: Run) -> list:
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:
        held = call.details.get("shifted_windows")
        rolled = held.get("rolled") if isinstance(held, dict) else None
        if not rolled:
            continue
        key = (call.where, tuple(rolled["shift"]), tuple(rolled["roll"]), tuple(rolled["map"]))
        if key not in done:
            done[key] = _finding(rolled)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(rolled: dict) -> Finding | None:
    shift, roll, dims = rolled["shift"], rolled["roll"], rolled["dims"]
    size = rolled.get("padded_after") or rolled["map"]  # (rolled before its padding: the roll is over its own size)
    axes = [i for i in range(len(size)) if _off(roll[i], shift[i], size[i])]
    if not axes:
        return None
    signed = tuple(r - n if 2 * r >= n else r for r, n in zip(roll, size))  # (-1 read as -1, not n - 1)
    said = ", ".join(f"axis {dims[i]} (length {size[i]}) by {abs(signed[i])}, not {shift[i]}" for i in axes)
    return Finding("swin-roll-shift", (
        f"the block states shift_size={tuple(shift)} (window_size={tuple(rolled['window'])}) but rolls its "
        f"{'x'.join(map(str, size))} map by {signed} along axes {tuple(dims)} before cutting windows: {said}; its "
        f"window mask, cut for the stated shift, no longer marks which tokens the roll brought together"),
        expected=f"the map rolled by -shift_size = {tuple(-s for s in shift)}",
        source=f"shift_size={tuple(shift)} of the block")


RULES = (
    Rule("swin-roll-shift", "wrong", "call", "a shifted-window block that rolls its map by another shift than its own "
         "shift_size, so its window mask no longer marks the regions (FengWu's longitude rolled by the latitude "
         "shift)", rolled_otherwise),
)
