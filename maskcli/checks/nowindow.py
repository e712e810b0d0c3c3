"""A module that states no window (`window_size=None`) whose attention cuts each image's map into windows anyway.

A windowed attention module holds its window size; None there states it has none: one window over the whole map
(lucidrains' ScalableViT: IWSA's `window_size=None`). trace/nowindow.py records, at a call made inside the innermost
module that states a window, where that window is None, the shape of the map the module was handed: B maps of T
tokens ((B, C, H, W) or (B, H, W, C): T = H x W; (B, N, D): T = N). A call over R > B rows of L queries and L keys
that covers every token of the B maps once (R x L = B x T, or B x T x the heads the module states, heads folded into
the rows) attends each map in R / B windows of L < T tokens: each query sees L of its map's T tokens. The module
chose those windows itself (lucidrains/vit-pytorch c2b2db2: `wsz = default(wsz, height)` took the map's height as the
window, so an H x kH map was cut into k square windows; the fix takes `default(wsz, width)` for the other side and
attends the whole map). Suspicious, not wrong: that None means the whole map is the module's own convention, which
maskcli cannot read (the condition is named). Quiet where the call attends the whole map (R = B), on
cross-attention, on a blockwise kernel's tiles of the queries or keys (trace/tiled.py), on maps of more than two axes
(a video's frames folded into the rows is a factorised attention's own design), and where the rows do not cover the
maps exactly once.
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _tokens(shape: tuple) -> set[int]:
    """The tokens per item of an input of `shape`: N of (B, N, D); H x W of (B, C, H, W) read either way round."""
    if len(shape) == 3:
        return {shape[1]}
    if len(shape) == 4:
        return {shape[2] * shape[3], shape[1] * shape[2]}
    return set()


def split_windows(run: Run) -> list:
    """Calls inside a module stating a None window that attend each of its maps in several windows."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:
        said = call.details.get("no_window")
        rows, q_len, k_len = int(call.shape[0]), int(call.shape[2]), int(call.shape[3])
        tile = call.details.get("tile")
        if not said or q_len != k_len or cross(call) \
                or tile and (tuple(tile[1]) != (0, q_len) or tuple(tile[2]) != (0, k_len)):
            continue  # (a tile of a blockwise kernel's queries or keys: the rest of the map is another call's)
        shape = tuple(said["input"])
        batch, heads = shape[0], int(call.details.get("stated_heads") or 1)
        if rows <= batch or rows % batch:
            continue
        folds = (1, heads) if heads > 1 and call.shape[1] == 1 else (1,)
        fold = next(((t, h) for t in sorted(_tokens(shape)) for h in folds
                     if batch * t * h == rows * q_len and t > q_len), None)
        if fold is None:
            continue
        tokens, folded = fold
        key = (said["said"], shape, call.shape)
        if key not in done:
            windows, item = tokens // q_len, "map" if len(shape) == 4 else "sequence"
            heads_said = f" (its {folded} heads folded in)" if folded > 1 else ""
            done[key] = Finding("none-window-split", (
                f"{said['said']} states no window, yet its attention runs the {batch} {item}s of {tokens} tokens "
                f"it was handed (input {'x'.join(map(str, shape))}) as {rows} rows{heads_said} of {q_len} queries "
                f"and keys: row 0's query 0 sees {q_len} of its {item}'s {tokens} tokens, not key {q_len} (its "
                f"{item}'s next window, in the order its rows hold its tokens), the {item} cut into {windows} windows; "
                f"wrong if a None window means one window over the whole {item}"),
                expected=f"each query sees its {item}'s {tokens} tokens", source=said["said"], cell=(0, 0, q_len))
        found.append((call, done[key]))
    return found


RULES = (
    Rule("none-window-split", "suspicious", "call", "a module stating window_size=None (no window) whose attention "
         "cuts each map it was handed into windows (the whole map expected)", split_windows),
)
