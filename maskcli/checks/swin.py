"""A shifted-window (Swin) mask that is not the one its block's own shift and window sizes fix.

Swin rolls its (H, W) map by -shift_size and cuts it into windows of window_size x window_size; tokens the roll
brought together from different regions of the map must not attend to each other, so the (nW, N, N) mask is fixed by
H, W, window_size and shift_size alone: label the map's 3 x 3 regions (rows and columns each cut at -window_size and
-shift_size), cut the labels into windows as the tokens are cut (row-major windows, row-major tokens in each), and
keep the pairs with one label (microsoft/Swin-Transformer's `calculate_mask`). A module that states `shift_size` and
`window_size` (trace/swin.py reads them and the mask the window attention holds) and holds another mask contradicts
itself: ResShift's channel-first port labelled `img_mask[:, h, w, :]` on a (1, 1, H, W) map, cutting regions along H
only and transposing each window's tokens (zsyOAOA/ResShift#81).

Tokens ordered column-major in each window are accepted too (a port that flattens windows the other way round
orders its tokens so); the map's size is the one the block rolled (trace/swinroll.py: the map it cut its windows
from, padded), else the module's `input_resolution` where it states one, else a square map; a mask repeated for each
image of the batch is read as that many copies. A mask built from the `input_resolution` the block was made for while
it runs on a map of another size is another map's mask (microsoft/esvit#9: the multi-crop views' smaller maps given
the global view's mask, broadcast over the wrong windows).
"""

from __future__ import annotations

import math

import numpy as np

from maskcli.checks.context import Run, first_cell
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def expected(height: int, width: int, window: int, shift: int, transposed: bool = False,
             real: tuple[int, int] | None = None) -> np.ndarray:
    """Bool (nW, N, N): Swin's shifted-window keep mask, by a loop over the map's regions and windows. `real`: the
    map's own size where the block rolls it first and pads it to whole windows after (KerasHub's Swin: the regions cut
    on the real map, the padding labelled 0 as window_partition pads the labels)."""
    labels = np.zeros((height, width), dtype=np.int64)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    count, cut = 0, labels[:real[0], :real[1]] if real else labels  # (a view: its regions are labels')
    for h in cuts:
        for w in cuts:
            cut[h, w] = count
            count += 1
    windows = []
    for top in range(0, height, window):
        for left in range(0, width, window):
            block = labels[top:top + window, left:left + window]
            windows.append((block.T if transposed else block).reshape(-1))
    windows = np.stack(windows)
    return windows[:, :, None] == windows[:, None, :]


def _map(held: dict, windows: int) -> tuple[int, int, int, str] | None:
    """(H, W, images, said): the map's size, how many images' windows the mask holds (a mask repeated per image) and
    where the size was read; images 0 where the map the block rolled holds a number of windows the mask's is not a
    multiple of (the mask was cut from another map)."""
    window = held["window"]
    rolled = (held.get("rolled") or {}).get("map")
    resolution = held.get("resolution")
    if rolled is not None:  # (the map the block cut its windows from, whatever it was built for)
        each = (rolled[0] // window) * (rolled[1] // window)
        said = "the map the block rolled" + (f"; its input_resolution is {resolution[0]}x{resolution[1]}"
                                             if resolution and tuple(resolution) != tuple(rolled) else "")
        return int(rolled[0]), int(rolled[1]), windows // each if windows % each == 0 else 0, said
    if resolution and resolution[0] % window == 0 and resolution[1] % window == 0:
        each = (resolution[0] // window) * (resolution[1] // window)
        if windows % each == 0:
            return int(resolution[0]), int(resolution[1]), windows // each, "its input_resolution"
    side = math.isqrt(windows)
    return (side * window, side * window, 1, "a square map") if side * side == windows else None


def window_facts(run: Run, name: str):
    """(call, what trace/swin.py read of `name` under the call's window block) for each call that has it."""
    for call in [*run.calls, *run.unmasked]:
        held = call.details.get("shifted_windows")
        value = held.get(name) if isinstance(held, dict) else None
        if value:
            yield call, value


def window_findings(run: Run, name: str, make, wanted=None) -> list:
    """(call, make(fact)) for each call with the fact `name` that `wanted(call, fact)` keeps (all, where None), the
    finding made once per call site and fact."""
    found, done = [], {}
    for call, fact in window_facts(run, name):
        if wanted is not None and not wanted(call, fact):
            continue
        key = (call.where, repr(fact))
        if key not in done:
            done[key] = make(fact)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def shifted_windows(run: Run) -> list:
    """Calls under a Swin block whose held window mask differs from the one its shift and window sizes fix."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:
        held = call.details.get("shifted_windows")
        if not held or held.get("window") is None:  # (a block read for its roll alone: checks/swinroll.py)
            continue
        keep = np.asarray(held["keep"], dtype=bool)
        key = (keep.tobytes(), keep.shape, held["window"], held["shift"], tuple(held.get("resolution") or ()),
               tuple((held.get("rolled") or {}).get("map") or ()))
        if key not in done:
            done[key] = _finding(held, keep)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(held: dict, keep: np.ndarray) -> Finding | None:
    size = _map(held, keep.shape[0])
    if size is None:
        return None
    (height, width, images, said), window, shift = size, held["window"], held["shift"]
    stated = f"the block states shift_size={shift}, window_size={window} over a {height}x{width} map ({said})"
    source = f"shift_size={shift}, window_size={window}"
    if not images:
        each = (height // window) * (width // window)
        return Finding("swin-mask-regions", (
            f"{stated}, cut into {each} windows per image, but the mask its window attention holds has "
            f"{keep.shape[0]} windows: it was built for another map, and its windows are laid on the wrong ones"),
            expected=f"Swin's mask for shift {shift}, window {window}, {each} windows per image", source=source)
    resolution = tuple(held.get("resolution") or ())
    after = (held.get("rolled") or {}).get("padded_after")  # (the block rolled its map, then padded it: trace/swinroll)
    real = tuple(after) if after else resolution if len(resolution) == 2 and resolution != (height, width) and all(
        -(-side // window) * window == padded for side, padded in zip(resolution, (height, width))) else None
    ways = [np.tile(expected(height, width, window, shift, transposed, at), (images, 1, 1))  # (the first: Swin's own)
            for at in ((real,) if after else (None, real) if real else (None,)) for transposed in (False, True)]
    if any(np.array_equal(keep, way) for way in ways):
        return None
    if after and any(np.array_equal(keep, np.tile(expected(height, width, window, shift, transposed), (images, 1, 1)))
                     for transposed in (False, True)):
        return Finding("swin-mask-regions", (
            f"{stated}, and it rolls its {after[0]}x{after[1]} map by the shift before padding it to {height}x{width}, "
            f"but the mask its window attention holds cuts the regions on the padded map: the tokens the roll wrapped "
            f"round sit before the padding, not at the map's end, so they see tokens from the far side of the image and "
            f"not their neighbours (pad the map first, then roll it)"),
            expected=f"Swin's mask for shift {shift}, window {window}, its regions cut on the {after[0]}x{after[1]} map",
            source=source, cell=first_cell(keep != ways[0]))
    meant = ways[0]
    differ = keep != meant
    w, q, k = first_cell(differ)
    how = "sees" if keep[w, q, k] else "hides"
    return Finding("swin-mask-regions", (
        f"{stated}, which fix its shifted-window mask, but the mask its window attention holds differs in "
        f"{int(differ.sum())} cells: in window {w}, token {q} {how} token {k} (the regions cut at another shift or "
        f"for another map, labelled along the wrong axes, or the windows' tokens reordered?)"),
        expected=f"Swin's mask for shift {shift}, window {window}", source=source, cell=(w, q, k))


RULES = (
    Rule("swin-mask-regions", "wrong", "call", "a shifted-window mask that differs from the one the block's own "
         "shift_size, window_size and map size fix (ResShift's regions labelled along the wrong axes)", shifted_windows),
)
