"""A model with multimodal rope handed one position per token over an image's tokens: the image laid out as text.

Qwen2-VL's rope (and Qwen2.5-VL's, Qwen3-VL's, GLM-4V's: a config whose rope parameters carry an `mrope_section`)
rotates each token by three positions, (t, h, w): text counts on in all three alike, an image's tokens sit on their
grid (one t, h by row, w by column: `get_rope_index`, from the `image_grid_thw` the call is handed). Handed
`position_ids` of one row per sample (B, L), transformers' Qwen2-VL copies them into t, h and w alike
(`position_ids[None].expand(3, ...)`), so an image of more than one token is rotated as a run of text: its tokens
one after another in every section, and the text after it counted from its last. Where that model call holds an
image's tokens (its config's `image_token_id` or `video_token_id` among the input ids, a grid of the call's
`image_grid_thw` / `video_grid_thw` rows more than one token), the program states a grid the positions it handed
cannot express: wrong (verl#1947: the dataset built 3-D positions only for an image processor class named exactly
`Qwen2VLImageProcessor`, and 1-D ones from the padding for any other). Handed no position_ids, the model
makes them itself: where its forward then holds (3, B, L) positions that lay the image's tokens one after another,
alike in t, h and w (trace/mropeused.py: ms-swift#2051's collator left them None, and the model of that time copied
its cache positions into every section), it is as wrong; and so where it is handed (3 or 4, B, L) ids that lay an
image's tokens so (ms-swift 48fb0a9, in #7038 before its merge: HunYuanVL's four rope rows made again for each image,
so every image but the last was numbered as text). Quiet where the call is handed ids that put every image on its
grid, or none and the model lays the grid itself (transformers' get_rope_index), and on a call whose input holds no
image token (a decode step's new token).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.configread import read, text_part
from maskcli.checks.context import Run
from maskcli.checks.mediapad import MEDIA
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def multimodal_rope(config) -> bool:
    """The config (or its text part) states multimodal rope: rope parameters with an `mrope_section`."""
    for part in (config, text_part(config)):
        for name in ("rope_parameters", "rope_scaling"):
            held = read(part, name)
            if isinstance(held, dict) and held.get("mrope_section"):
                return True
    return False


def _image_runs(ids: np.ndarray, image: int) -> list[tuple[int, int, int]]:
    """(batch row, first, last) of each run of two or more image tokens along the rows, in order."""
    at = np.pad(ids == image, ((0, 0), (1, 1)))
    edges = np.diff(at.astype(np.int8), axis=1)  # (+1 where a run begins, -1 past its end: no loop per token)
    found = []
    for b in range(ids.shape[0]):
        begins, ends = np.flatnonzero(edges[b] == 1), np.flatnonzero(edges[b] == -1) - 1
        found += [(b, int(first), int(last)) for first, last in zip(begins, ends) if last > first]
    return found


def _used(top) -> tuple[np.ndarray, str] | None:
    """((C, B, L) positions, the forward that held them) a model call's forward made itself and rotated its queries
    with (trace/mropeused.py), else None."""
    used = top.arguments.get("mrope_used")
    return None if not isinstance(used, dict) else (used["rows"], used["function"])


def _flat(positions: np.ndarray, b: int, first: int, last: int) -> bool:
    """The image's tokens `first`..`last` of batch row `b` sit one after another, alike in every section."""
    rows = positions[:, b if positions.shape[1] > b else 0, first:last + 1]
    return bool((rows == rows[:1]).all() and (np.diff(rows[0]) == 1).all())


def flat_grid(run: Run) -> list:
    """Model calls of a multimodal-rope model handed (B, L) position_ids over an image's tokens, or that laid them so
    itself where it was handed none."""
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        if top is None or id(top) in done:
            continue
        done.add(id(top))
        arguments = top.arguments
        positions, ids = arguments.get("position_ids"), arguments.get("input_ids")
        grids = [arguments[n] for n in ("image_grid_thw", "video_grid_thw") if isinstance(arguments.get(n), np.ndarray)]
        if not grids or not isinstance(ids, np.ndarray) or ids.ndim != 2 or top.config is None \
                or not multimodal_rope(top.config):
            continue
        handed, made = arguments.get("mrope_position_ids"), None
        if isinstance(handed, np.ndarray) and handed.ndim == 3 and handed.shape[0] >= 3 \
                and handed.shape[2] == ids.shape[1]:  # (its (C, B, L) ids handed: an image laid as text among them is
            how, sections = "handed", handed  # as wrong, ms-swift 48fb0a9)
        elif "position_ids" not in arguments and "mrope_position_ids" not in arguments:
            used = _used(top)  # (handed none: what its forward made of them)
            if used is None or used[0].shape[2] != ids.shape[1]:
                continue
            how, (sections, made) = "made", used
        elif isinstance(positions, np.ndarray) and positions.ndim == 2 and positions.shape[1] == ids.shape[1]:
            how, sections = "flat", None
        else:
            continue
        tokens = [t for n in MEDIA if isinstance(t := read(top.config, n), int)]  # (the config's image and video ids)
        runs = [(t, r) for t in tokens for r in _image_runs(ids, t)]
        if not runs or not any(g.ndim == 2 and g.shape[1] == 3 and (g.prod(axis=1) > 1).any() for g in grids):
            continue
        # (each image of the ids handed is read; of (B, L) ids or ids the model made itself, the first image alone:
        # the model's numbering follows the call's attention_mask, which other rules judge)
        runs = [(t, r) for t, r in (runs if how == "handed" else runs[:1]) if how == "flat" or _flat(sections, *r)]
        if not runs:
            continue
        token, (b, first, last) = runs[0]
        rows = (positions[b] if positions.shape[0] > b else positions[0]) if how == "flat" \
            else sections[0, b if sections.shape[1] > b else 0]
        shape = tuple((positions if how == "flat" else sections).shape)
        said = {"flat": f"was handed position_ids of one row per sample {shape}",
                "handed": f"was handed multimodal rope ids {shape}",
                "made": f"was handed no position_ids, and its {made} rotated with {shape} ones it made"}
        fix = {"flat": ", or no position_ids", "handed": ", each image on its grid",
               "made": ", or have its forward make them where it is handed none"}
        found.append((call, Finding("flat-image-positions", (
            f"{top.where} {said[how]} beside an image grid, with rope parameters that state multimodal rope "
            f"(mrope_section): batch row {b}'s image tokens {first}-{last} (id {token}) are at positions "
            f"{int(rows[first])}-{int(rows[last])} in t, h and w alike, one after another as text, not on their "
            f"(t, h, w) grid (hand the model its get_rope_index ids, (3, B, L){fix[how]})"),
            expected="(t, h, w) grid positions from get_rope_index",
            source={"flat": f"position_ids of {top.where}", "handed": f"mrope_position_ids of {top.where}",
                    "made": made}[how], cell=(b, first, first))))
    return found


RULES = (
    Rule("flat-image-positions", "wrong", "call", "a model whose rope parameters state multimodal rope (mrope_section) "
         "handed (B, L) position_ids over an image of more than one token: the image rotated as a run of text, not "
         "on its (t, h, w) grid", flat_grid),
)
