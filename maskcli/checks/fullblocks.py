"""A vision tower that states which of its blocks attend over the whole image, whose full and windowed blocks see one mask.

Qwen2.5-VL's vision encoder runs most blocks inside windows (`cu_window_seqlens`) and the blocks of
`fullatt_block_indexes` over each whole image (`cu_seqlens`); vLLM and cosmos-rl copy that list onto the tower
(trace/stated.py reads it) and pick each block's segments by it. Where a full block and a windowed block of one model
call see the very same mask, the selection did nothing: the full blocks run windowed (cosmos-rl compared string
ModuleDict keys with the int list) or the windowed ones over the whole image (vLLM #15200 built the windowed layers'
mask from the image seqlens). Wrong where the model call was handed both segmentations and they differ (trace/tops.py
keeps `cu_seqlens` and `cu_window_seqlens`), or where the tower's config states its window (`window_size` pixels over
`patch_size`-pixel patches: transformers' vision config) and a query sees more patches than one window holds; quiet
where it sees no more (every image fits inside one window: both kinds rightly see it all); suspicious where nothing
states either. A full block that sees only a part of what a windowed block sees (every cell of its within the
windowed one's, fewer somewhere) is wrong wherever the program states the full blocks: a window is a part of its
image, so the two kinds' segments are swapped (Pai-Megatron-Patch#552). Each block's calls are compared whole
(transformers' SDPA path attends one window or image per call).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep, layer
from maskcli.checks.registry import Rule
from maskcli.text import Finding

FIELD = "fullatt_block_indexes"


def _segments(cu: np.ndarray, length: int) -> np.ndarray | None:
    """Bool (length, length): the block-diagonal mask of cumulative segment ends `cu`; None where they do not span it."""
    cu = np.asarray(cu).reshape(-1)
    if cu.size < 2 or int(cu[0]) != 0 or int(cu[-1]) != length or np.any(np.diff(cu) < 0):
        return None
    ids = np.searchsorted(cu[1:], np.arange(length), side="right")
    return ids[:, None] == ids[None, :]


def _window(top) -> tuple[int, str] | None:
    """(patches in one window, where it is said) from the tower's config (Qwen2.5-VL's vision config: `window_size`
    pixels over `patch_size`-pixel patches), the model's own or its `vision_config`; None where it states none."""
    for config in (top.config, getattr(top.config, "vision_config", None)):
        size, patch = getattr(config, "window_size", None), getattr(config, "patch_size", None)
        if type(size) is int and type(patch) is int and 0 < patch <= size and size % patch == 0:
            return (size // patch) ** 2, f"window_size={size} over patch_size={patch} ({type(config).__name__})"
    return None


def same_mask(run: Run) -> list:
    """Per model call stating FIELD: its first full block whose masks (all its calls') equal a windowed block's, once."""
    found = []
    for top in run.tops:
        said = [one for one in top.stated if FIELD in one.fields]
        if not said:
            continue
        full, source = set(said[0].fields[FIELD]), said[0].source
        scope = said[0].scope or ""
        blocks: dict = {}  # block number -> its calls of this model call, in order
        for call in run.made_by(top):
            index = layer(call)
            if index is None or scope and not (call.where or "").startswith(scope):
                continue
            cells = keep(call)
            if cells is not None:
                blocks.setdefault(index, []).append((call, cells))
        # a block's every call, compared whole: a tower that attends one window or image per call (transformers'
        # SDPA path splits by cu_seqlens) has a small image's one call alike in both kinds, but not all its calls
        sign = {index: tuple((cells.shape, cells.tobytes()) for _, cells in made) for index, made in blocks.items()}
        hit = next(((f, w) for f in sorted(blocks) if f in full for w in sorted(blocks)
                    if w not in full and sign[f] == sign[w]), None)
        if hit is None:
            swapped = _narrower(blocks, full)
            if swapped is not None:
                found.append(_swapped(*swapped, source))
            continue
        index, other = hit
        call, cells = blocks[index][0]
        image, window = top.arguments.get("cu_seqlens"), top.arguments.get("cu_window_seqlens")
        length = cells.shape[-1]
        image = None if image is None else _segments(image, length)
        window = None if window is None else _segments(window, length)
        if image is not None and window is not None and np.array_equal(image, window):
            continue  # each image is one window: the program states the two segmentations the same
        sure = image is not None and window is not None
        widest = max(int(cells.sum(-1).max()) for _, cells in blocks[index])  # keys one query sees, at most
        held = None if sure else _window(top)
        if held is not None and widest <= held[0]:
            continue  # every image fits inside one window the config states: both kinds rightly see the image
        plane = cells.reshape(-1, length, length)
        if sure and all(np.array_equal(p, window) for p in plane):
            how = "both run inside the windows (cu_window_seqlens): the full blocks are never selected"
        elif sure and all(np.array_equal(p, image) for p in plane):
            how = "both run over the whole image (cu_seqlens): the windowed blocks never get their windows"
        elif held is not None:
            sure, how = True, (f"a query of the windowed block sees {widest} keys, more than the {held[0]} patches of "
                               f"one window ({held[1]}): the windowed blocks never get their windows")
        else:
            how = "the selection of each block's segments changed nothing"
        found.append((call, Finding("full-blocks-windowed", (
            f"block {index} is a full-attention block ({source}) and block {other} a windowed one, but they see the "
            f"same mask: {how}" + ("" if sure else ", unless every image fits inside one window")),
            severity=None if sure else "suspicious", expected="the image's segments (cu_seqlens)", source=source)))
    return found


def _narrower(blocks: dict, full: set) -> tuple | None:
    """(full block, windowed block) where the full block's every call sees a part of what the windowed block's call
    at the same place sees, and strictly less somewhere (a window is a part of its image, never more); None else."""
    for f in sorted(blocks):
        for w in sorted(blocks):
            if f not in full or w in full or len(blocks[f]) != len(blocks[w]):
                continue
            pairs = [(a, b) for (_, a), (_, b) in zip(blocks[f], blocks[w])]
            if all(a.shape == b.shape and not np.any(a & ~b) for a, b in pairs) and \
                    any(np.any(b & ~a) for a, b in pairs):
                return (blocks[f], blocks[w], f, w)
    return None


def _swapped(made, other_made, index: int, other: int, source: str) -> tuple:
    """The finding for a full block that sees less than a windowed one: the two kinds' segments swapped."""
    call, cells = made[0]
    widest = max(int(c.sum(-1).max()) for _, c in made)
    most = max(int(c.sum(-1).max()) for _, c in other_made)
    return (call, Finding("full-blocks-windowed", (
        f"block {index} is a full-attention block ({source}) and block {other} a windowed one, but the full block "
        f"sees only a part of what the windowed one sees (at most {widest} keys a query against {most}): a window is "
        f"a part of its image, so the full and windowed blocks' segments are swapped"),
        severity=None, expected="the image's segments (cu_seqlens)", source=source))


RULES = (
    Rule("full-blocks-windowed", "wrong", "steps", "a vision tower whose full-attention blocks (fullatt_block_indexes) "
         "and windowed blocks see one mask: the full blocks never selected, or the windows never applied", same_mask),
)
