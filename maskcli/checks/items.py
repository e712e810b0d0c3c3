"""A vision tower handed several images (or a video's frames) that joins them in one sequence where they see each other.

Vision towers that take images of different sizes concatenate their patches along one axis and keep each image apart
with a block-diagonal mask, varlen segments, or one attention call per image. The model call states where each image
begins and ends (trace/tops.py keeps it): a `grid_thw` (`image_grid_thw`, `video_grid_thw`), one (t, h, w) row of
patches per image or video (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, GLM-4V's, HunyuanOCR's towers), or a list of image
tensors of different sizes, each (H / p) x (W / p) patches for the tower's first strided convolution (its patch
embedding: eole's and pixtral's `images`). An attention call over exactly the sum of those patches whose query sees
a key of another image contradicts that statement (vLLM#30344: HunyuanOCR's blocks ran over every image's patches
with no mask; eole#280: its HunyuanOCR path passed `mask=None`).

Inside one grid_thw row of t > 1 temporal patches (a video), the reference towers attend each frame alone
(`repeat_interleave(h * w, t)` in transformers' Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V vision encoders): a query
that sees another frame of its video is *wrong* where the tower names one of those families (its class or its
config's model_type), as sglang#11458's cu_seqlens from t * h * w did; *suspicious* elsewhere (a tower may attend a
video jointly on purpose), and not judged in a module named temporal (it attends across frames by its name).

The calls judged are those over all the stated patches, or the calls of one layer that hold them one part after
another (one call per image or per segment, as transformers' SDPA path splits by cu_seqlens). Quiet where every call
sees only its own image (and frame; a windowed block's reordered windows stay inside their image), on a list of images
all of one size (multi-view models attend their views jointly on purpose), on cross-attention, and on masks that are
not symmetric (a causal text decoder's calls inside the same model call: a tower attends both ways).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, layer
from maskcli.checks.registry import Rule
from maskcli.text import Finding

GRIDS = ("grid_thw", "image_grid_thw", "video_grid_thw")
# families whose reference vision encoder attends each temporal patch of a video alone (cu_seqlens per frame)
PER_FRAME = re.compile(r"qwen\d[\d_]*_?(vl|vision)|glm_?4v|ernie_?4_5_?vl|paddleocr_?vl", re.I)
TEMPORAL = re.compile(r"tempor", re.I)


def _patches(size: int, axis: tuple) -> int:
    kernel, stride, padding, dilation, ceil = axis
    span = size + 2 * max(padding, 0) - dilation * (kernel - 1) - 1
    return (-(-span // stride) if ceil else span // stride) + 1


def _items(top) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """(patches per item, patches per frame of each item, where it is said) for each statement of the model call: each
    grid it was given (a model's image_grid_thw and video_grid_thw run through its tower apart), its list of images."""
    found = [_grid(top, name) for name in GRIDS] + [_listed(top)]
    return [one for one in found if one is not None]


def _grid(top, name: str) -> tuple[np.ndarray, np.ndarray, str] | None:
    """A grid argument's items: (t, h, w) patches each, h * w a frame."""
    grid = top.arguments.get(name)
    if not isinstance(grid, np.ndarray) or grid.ndim != 2 or grid.shape[1] != 3 or not grid.size or (grid <= 0).any():
        return None
    rows = ", ".join(f"({t}, {h}, {w})" for t, h, w in grid[:4].tolist()) + (", ..." if len(grid) > 4 else "")
    return grid.prod(1), grid[:, 1] * grid[:, 2], f"the model call's {name} [{rows}]"


def _listed(top) -> tuple[np.ndarray, np.ndarray, str] | None:
    """A list of images' items: (H / p) x (W / p) patches each for the tower's first strided convolution (else its
    config's patch_size), where the images are not all of one size."""
    held = top.arguments.get("image_shapes")
    if not held or len(set(held[1])) < 2:
        return None  # (images all of one size: views a multi-view model may attend jointly)
    name, shapes = held
    convs = top.arguments.get("convs") or ()
    patch = getattr(top.config, "patch_size", None)
    axes = convs[0] if convs else ((patch, patch, 0, 1, False),) * 2 if type(patch) is int and patch > 0 else None
    if axes is None:
        return None
    counts = np.array([_patches(h, axes[0]) * _patches(w, axes[1]) for h, w in shapes])
    if (counts <= 0).any():
        return None
    sizes = ", ".join(f"{h}x{w}" for h, w in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
    return counts, counts, (f"the model call's {name}: {len(shapes)} images of {sizes} pixels, "
                            f"{', '.join(str(int(c)) for c in counts[:4])}{', ...' if len(counts) > 4 else ''} patches")


def _family(top) -> str | None:
    """The per-frame family the tower names (its class or its config's model_type), or None."""
    config = top.config
    for said in (top.where, type(config).__name__ if config is not None else "", getattr(config, "model_type", None),
                 top.arguments.get("module_class")):
        if isinstance(said, str) and PER_FRAME.search(said.replace("-", "_").replace(".", "_")):
            return said
    return None


def placed(run: Run, top, length: int) -> list[tuple[object, int]]:
    """(call, offset of its first token) for each self-attention call of the model call over its `length` packed tokens:
    a call over all of them, or the calls of one layer that hold them one part after another, in order (one call per
    image, or per request: transformers' SDPA path splits a tower's sequence by cu_seqlens); other calls left out."""
    by_layer: dict = {}
    for call in run.made_by(top):
        if not cross(call) and call.shape[0] == 1 and call.shape[2] == call.shape[3] <= length:
            by_layer.setdefault((layer(call), call.where), []).append(call)
    found = []
    for calls in by_layer.values():
        whole = [call for call in calls if call.shape[2] == length]
        if whole:
            found += [(call, 0) for call in whole]
        elif sum(call.shape[2] for call in calls) == length:
            offsets = np.cumsum([0] + [call.shape[2] for call in calls])[:-1]
            found += [(call, int(offset)) for call, offset in zip(calls, offsets)]
    return sorted(found, key=lambda one: one[0].index)


def joined(run: Run) -> list:
    """Per model call stating its items: the first attention call over all of them whose query sees another item's key
    (or, in a video, another frame's), once per model call."""
    found = []
    for top in run.tops:
        for counts, frame, source in _items(top):
            found += _judged(run, top, counts, frame, source)
    return found


def _judged(run: Run, top, counts: np.ndarray, frame: np.ndarray, source: str) -> list:
    """The first call of the model call over these items whose query sees another item's (or frame's) key."""
    found = []
    total = int(counts.sum())
    item = np.repeat(np.arange(len(counts)), counts)
    frames = np.repeat(np.arange(int((counts // frame).sum())), np.repeat(frame, counts // frame)) \
        if (counts % frame == 0).all() else item
    family = _family(top)
    for call, offset in placed(run, top, total):
        cells = keep(call)
        if cells is None:
            continue
        n = call.shape[2]
        own, frame_ids = item[offset:offset + n], frames[offset:offset + n]
        seen = cells.any(axis=(0, 1))
        if not np.array_equal(seen, seen.T):
            continue  # (a vision tower attends both ways: a causal text decoder's calls are not its)
        across = seen & (own[:, None] != own[None, :])
        if across.any():
            q, k = first_cell(across)
            q, k = q + offset, k + offset
            found.append((call, Finding("items-joined", (
                f"patch {q} (image {item[q]}) sees patch {k} of image {item[k]} in one sequence of {total} "
                f"patches, where {source} states them separate images"),
                expected="each image's patches see only their own image", source=source)))
            break
        inside = seen & (frame_ids[:, None] != frame_ids[None, :])
        if inside.any() and not TEMPORAL.search(call.where or ""):
            q, k = first_cell(inside)
            q, k = q + offset, k + offset
            sure = family is not None
            found.append((call, Finding("items-joined", (
                f"patch {q} (frame {frames[q]}) sees patch {k} of frame {frames[k]} of the same video: {source} "
                f"gives it {int(counts[item[q]] // frame[item[q]])} temporal patches of {int(frame[item[q]])}, "
                "which the reference vision encoders attend one by one (cu_seqlens from repeat_interleave(h * w, t))"
                + (f", as the reference encoder of the family {family} names does" if sure
                   else ", unless this tower attends a video's frames jointly")),
                severity=None if sure else "suspicious", expected="each frame's patches see only their own frame",
                source=source)))
            break
    return found


RULES = (
    Rule("items-joined", "wrong", "steps", "a vision tower over several images (grid_thw, a list of images) or a video's "
         "frames in one sequence, whose queries see another image's (or frame's) patches", joined),
)
