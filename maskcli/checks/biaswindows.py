"""A per-head position bias added to blocked local-attention scores whose heads are folded with the batch: its head
axis lines up with the windows.

A blocked local attention (lucidrains' local-attention, a hand-written sliding-chunk layer) scores each window of a
sequence against its look-around keys and lays the scores out (B * H, N, Lq, Lk): the heads folded with the batch on
the first axis, the N windows on the second. The program states that layout: the scores' first axis is the layer's
input batch B (its forward's first argument, (B, L, D)) times the heads its module holds (trace/queried.py's
details["heads_folded"] beside details["stated_heads"]), and N windows of Lq queries hold its L positions. A bias of one
plane per head, (H, Lq, Lk) (a dynamic position bias's MLP with H outputs, T5's buckets embedded to H values), added
to those scores as it is, broadcasts its head axis onto the windows (trace/posbias.py keeps the addends' shapes): only
where N == H does the sum run at all, and then window w of every head gets head w's bias. The bias then differs from
window to window of one head, at the same distance k - q, where a head's bias is one function of k - q: *wrong*
wherever two windows' planes differ (local-attention ab766fd: the fix repeats the bias to (B * H, 1, Lq, Lk)). Quiet
where the bias has an axis over the folded batch and heads, where its planes are one (a bias shared by the heads), or
where they agree on every distance both see.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding

TOLERANCE = 1e-4  # of the bias's largest value: float32 sums


def _planes(call) -> tuple | None:
    """(the bias's shape, N) where one addend of the scores holds a plane per head on the windows' axis: (.., H, Lq or
    1, Lk) with no axis over the folded batch and heads, H == N == the heads the module states; None otherwise."""
    heads, folded = call.details.get("stated_heads"), call.details.get("heads_folded")
    if not isinstance(heads, int) or not folded or len(call.shape) != 4:
        return None
    batch, length = (int(x) for x in folded)
    rows, windows, q_len, k_len = (int(x) for x in call.shape)
    if heads < 2 or rows != batch * heads or windows != heads or not (windows - 1) * q_len < length <= windows * q_len:
        return None  # (not the heads folded with the batch beside N windows of the layer's positions)
    for shape in call.details.get("bias_shapes") or ():
        if len(shape) >= 3 and shape[-3] == windows and all(d == 1 for d in shape[:-3]) \
                and shape[-2] in (1, q_len) and shape[-1] == k_len:
            return tuple(shape), windows
    return None


def _table(found: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(low, high), each (planes, distances), NaN where no kept cell lay at that distance."""
    if "low" not in found:
        return None
    low = np.array([[np.nan if v is None else v for v in row] for row in found["low"]], dtype=float)
    high = np.array([[np.nan if v is None else v for v in row] for row in found["high"]], dtype=float)
    return low, high


def on_windows(run: Run) -> list:
    """A per-head bias (H, Lq, Lk) added to (B * H, N, Lq, Lk) scores: window w of head 0 gets head w's bias."""
    found, done = [], set()
    for call in run.calls:
        placed = _planes(call)
        profile = call.details.get("position_bias")
        if placed is None or not isinstance(profile, dict) or (call.mask, call.shape, placed[0]) in done:
            continue  # (said once for every layer that adds the same bias to the same layout)
        table = _table(profile)
        if table is None or table[0].shape[0] != placed[1]:
            continue
        done.add((call.mask, call.shape, placed[0]))
        low, high = table
        reach = (low.shape[1] - 1) // 2  # distances -reach .. reach
        scale = max(float(np.nanmax(np.abs(np.concatenate([low, high])))), 1e-12)
        exact = np.isfinite(low) & np.isfinite(high) & (np.abs(high - low) <= TOLERANCE * scale)  # one value a distance
        q_len, k_len = int(call.shape[2]), int(call.shape[3])
        cell = None
        for window in range(1, placed[1]):
            differ = exact[0] & exact[window] & (np.abs(low[window] - low[0]) > TOLERANCE * scale)
            if not differ.any():
                continue
            distances = np.flatnonzero(differ) - reach  # (k - q, in the keys' order)
            before = k_len - q_len  # (the look-around keys before a window's first query: queries end the keys)
            query = np.maximum(0, -distances - before)  # the first query of the window that reaches each distance
            pick = int(np.lexsort((distances, query))[0])
            d, i = int(distances[pick]), int(query[pick])
            cell = (window, d, window * q_len + i)
            break
        if cell is None:
            continue
        window, d, q = cell
        batch, length = call.details["heads_folded"]
        shape = "(" + ", ".join(str(x) for x in placed[0]) + ")"
        scores = "(" + ", ".join(str(int(x)) for x in call.shape) + ")"
        given, own = low[window, d + reach], low[0, d + reach]
        found.append((call, Finding("position-bias-on-windows", (
            f"{call.where}: the position bias added to the scores is {shape}, one plane per head (the module states "
            f"{placed[1]} heads), but the scores are {scores}: their first axis the layer's {batch} batch rows x "
            f"{placed[1]} heads, their second the {placed[1]} windows of {q_len} of its {length} positions, so "
            f"broadcasting lays plane w on window w of every head. Query {q} (window {window}) of batch row 0, head 0, "
            f"gets head {window}'s bias toward key {q + d} (distance {d}: {given:+.4g} against its own key) where head "
            f"0's is {own:+.4g}, as its window 0 gets (step {call.step}): the bias follows the window, not the head"),
            expected=f"each head's own bias in every window: {shape} laid (B * H, 1, {q_len}, {k_len})",
            source=f"the {placed[1]} heads its module states and the layer's ({batch}, {length}) input",
            cell=(0, q, q + d))))
    return found


RULES = (
    Rule("position-bias-on-windows", "wrong", "call", "a per-head position bias (H, Lq, Lk) added to blocked "
         "local-attention scores laid (B * H, N windows, Lq, Lk): its head axis broadcasts onto the windows, so "
         "window w of every head gets head w's bias (lucidrains/local-attention ab766fd)", on_windows),
)
