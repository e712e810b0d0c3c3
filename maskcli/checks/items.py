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

Quiet where every call sees only its own image (and frame), on calls of another length (one image per call, a
windowed block's reordered windows stay inside their image), on a list of images all of one size (multi-view models
attend their views jointly on purpose), and on cross-attention.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
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


def _items(top) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(patches per item, patches per frame of each item, where it is said) the model call states; None where none."""
    for name in GRIDS:
        grid = top.arguments.get(name)
        if isinstance(grid, np.ndarray) and grid.ndim == 2 and grid.shape[1] == 3 and grid.shape[0] >= 1 \
                and (grid > 0).all():
            rows = ", ".join(f"({t}, {h}, {w})" for t, h, w in grid[:4].tolist()) + (", ..." if len(grid) > 4 else "")
            return grid.prod(1), grid[:, 1] * grid[:, 2], f"the model call's {name} [{rows}]"
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


def joined(run: Run) -> list:
    """Per model call stating its items: the first attention call over all of them whose query sees another item's key
    (or, in a video, another frame's), once per model call."""
    found = []
    for top in run.tops:
        stated = _items(top)
        if stated is None:
            continue
        counts, frame, source = stated
        total = int(counts.sum())
        item = np.repeat(np.arange(len(counts)), counts)
        frames = np.repeat(np.arange(int((counts // frame).sum())), np.repeat(frame, counts // frame)) \
            if (counts % frame == 0).all() else item
        family = _family(top)
        for call in run.calls[top.first:top.end]:
            if call.shape[2] != total or call.shape[3] != total:
                continue
            cells = keep(call)
            if cells is None:
                continue
            seen = cells.any(axis=(0, 1))
            across = seen & (item[:, None] != item[None, :])
            if len(counts) > 1 and across.any():
                q, k = first_cell(across)
                found.append((call, Finding("items-joined", (
                    f"query {q} (image {item[q]}) sees key {k} of image {item[k]} in one sequence of {total} patches, "
                    f"where {source} states them separate images"),
                    expected="each image's patches see only their own image", source=source)))
                break
            inside = seen & (frames[:, None] != frames[None, :])
            if inside.any() and not TEMPORAL.search(call.where or ""):
                q, k = first_cell(inside)
                sure = family is not None
                found.append((call, Finding("items-joined", (
                    f"query {q} (frame {frames[q]}) sees key {k} of frame {frames[k]} of the same video: {source} "
                    f"gives it {int(counts[item[q]] // frame[item[q]])} temporal patches of {int(frame[item[q]])}, "
                    "which the reference vision encoders attend one by one (cu_seqlens from repeat_interleave(h * w, t))"
                    + (f", as {family} does" if sure else ", unless this tower attends a video's frames jointly")),
                    severity=None if sure else "suspicious", expected="each frame's patches see only their own frame",
                    source=source)))
                break
    return found


RULES = (
    Rule("items-joined", "wrong", "steps", "a vision tower over several images (grid_thw, a list of images) or a video's "
         "frames in one sequence, whose queries see another image's (or frame's) patches", joined),
)
