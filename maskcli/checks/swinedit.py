"""A shifted-window block whose forward edited its own shift_size in place, run unshifted where its shift cuts.

A block that states `shift_size` > 0 along an axis cuts the rolled map into windows there, and its mask hides the
pairs the roll brought together, wherever the map holds more than one window along that axis. torchvision's
`shifted_window_attention` zeroed `shift_size[i]` in place where the window covers a small map (pytorch/vision#6266),
and the list it edited was the module's own: after one small input, every later call runs with no shift and no mask.
trace/assigned.py keeps what the program last assigned to each block's shift_size and reads the map its forward runs
on; where the block's field now differs from that (an edit, not the program's assignment) and an axis whose assigned
shift is > 0, now 0, holds more than one window of the map, a call that masks nothing contradicts the shift the
program set. Quiet where the shift was only assigned (Swin's own `self.shift_size = 0` for a small map in __init__),
where each edited axis holds one window (the shift is moot there), and where the call masks something.
"""

from __future__ import annotations

import math

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.checks.swin import window_facts
from maskcli.text import Finding


def edited_shift(run: Run) -> list:
    found = []
    for call, edited in window_facts(run, "edited"):
        if edited["map"] is None:
            continue
        assigned, now, window, size = edited["assigned"], edited["now"], edited["window"], edited["map"]
        axes = [i for i in range(2)
                if 0 < assigned[i] < window[i] and now[i] == 0 and math.ceil(size[i] / window[i]) > 1]
        if not axes or call.stored is not None and not _hides_nothing(call):
            continue
        said = ", ".join(f"axis {i} ({size[i]} long, {math.ceil(size[i] / window[i])} windows)" for i in axes)
        found.append((call, Finding("swin-shift-edited", (
            f"the program set this block's shift_size to {list(assigned)}, but a forward edited that list in place to "
            f"{list(now)}: this call runs a {size[0]}x{size[1]} map, whose {said} the stated shift cuts, with no shift "
            f"and no shifted-window mask (copy the list before zeroing it for a small map)"),
            expected=f"the windows shifted by {list(assigned)} and their mask", source=f"shift_size={list(assigned)} "
            f"as assigned")))
    return found


def _hides_nothing(call) -> bool:
    cells = keep(call)
    return cells is not None and bool(cells.all())


RULES = (
    Rule("swin-shift-edited", "wrong", "call", "a shifted-window block whose forward edited its own shift_size list "
         "in place, so later maps larger than its window run unshifted and unmasked (torchvision's in-place zeroing)",
         edited_shift),
)
