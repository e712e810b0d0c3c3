"""One call site whose position bias (ALiBi, relative buckets) is not the same function of k - q at every step.

A relative-position bias added to the scores depends on the key's distance from the query alone, up to one constant per
query row (trace/posbias.py reads it so: each query row less its value at its own column). A site's full pass, as many
queries as keys and query i at key i, states that function: where every query row of every batch row and head agrees
on it (one value per distance, each distance seen in two cells or more, not 0 everywhere), the program has said what
its bias is. A later step of the same site
whose queries sit at the end of its keys (a cached decode step, a chunk; the trace places them so) must add the same
function of the same distances; where it adds another one, its bias rows are not its queries' own:
TransformerLens#777 sliced ALiBi `alibi[:, :query_ctx, :key_ctx]`, so a cached decode step at position p got row 0 (no
distance bias at all) instead of row p. Quiet where the full pass's bias is not a function of k - q (Swin's 2-D
offsets, an absolute bias, a bias that differs per batch row, one that another full pass of the site adds otherwise:
XLNet's content-dependent position term; a later step whose own cells disagree at one distance, or that is off by
less than a quarter of what the bias spans), where the bias is 0 on every kept cell (a mask added),
on distances one of the two steps does not see, and on calls whose key columns are not positions (ring slots).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding

TOLERANCE = 1e-3  # of the full pass's largest bias: float32 sums, a float16 cast's rounding beside them
SHIFTED = 0.25  # of the span of a head's bias over the distances its full pass sees: what a misplaced row is off by


def _values(found: dict, width: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(low, high), each (heads, distances), NaN where the step saw no cell at that distance (`width` distances, the
    middle one 0, where the step recorded a bias of 0 on every kept cell)."""
    heads = found.get("heads")
    if "zero" in found:
        if width is None:
            return None
        first, last = found["zero"]
        span = np.arange(width) - width // 2
        row = np.where((span >= first) & (span <= last), 0.0, np.nan)
        return np.tile(row, (heads, 1)), np.tile(row, (heads, 1))
    low = np.array(found["low"], dtype=np.float64)  # (None read as NaN)
    high = np.array(found["high"], dtype=np.float64)
    return (low, high) if low.shape == high.shape and low.shape[0] == heads else None


def _end_aligned(run: Run, call) -> bool:
    """Its queries are the last of its keys (query i at key Lk - Lq + i), keys on positions."""
    q_len, k_len = call.shape[2:]
    _, own, positions = run.placed(call)
    return bool(positions) and len(own) == q_len and np.array_equal(own, np.arange(k_len - q_len, k_len))


def _stated(found: dict) -> tuple[np.ndarray, float] | None:
    """The function of k - q a full pass states (heads, distances), and the tolerance; None where it states none."""
    read = _values(found) if "low" in found else None
    if read is None:
        return None
    low, high = read
    seen = np.isfinite(low) & (np.array(found.get("count", 0)) >= 2)  # (a distance one cell shows: nothing agrees on it)
    scale = max(float(np.abs(low[seen]).max(initial=0.0)), float(np.abs(high[seen]).max(initial=0.0)))
    tolerance = max(TOLERANCE * scale, 1e-6)  # (of the bias's own size: XLNet's content-dependent term, 0.02 across
    # rows from random weights, agreed within 1e-3 of 1 and was read as one function of k - q)
    if not seen.any() or not (np.abs(low[seen]) > tolerance).any() or (high[seen] - low[seen] > tolerance).any():
        return None
    return np.where(seen, (low + high) / 2, np.nan), tolerance


def _worst(stated: np.ndarray, tolerance: float, found: dict) -> tuple[int, int, float, float] | None:
    """(head, distance, stated, added) where a step adds another bias than the stated one at a distance both see."""
    read = _values(found, stated.shape[1])
    if read is None or read[0].shape != stated.shape:
        return None
    low, high = read
    if (np.nan_to_num(high - low) > tolerance).any():
        return None  # (the step's own rows, batch rows or streams disagree at one distance: its bias is no function of
        # k - q alone, XLNet's q · R with its query stream's content; a row given to other queries is one)
    off = np.fmax(np.abs(low - stated), np.abs(high - stated))  # (NaN where either step saw nothing there)
    off = np.where(np.isfinite(off), off, 0.0)
    # a row given to other queries is off by the bias's change over whole distances: a quarter of what it spans over
    # the distances seen at least (XLNet's position term, q · R, drifts by a tenth with the query's content)
    spread = np.nanmax(stated, axis=1, keepdims=True) - np.nanmin(stated, axis=1, keepdims=True)
    off = np.where(off > np.maximum(tolerance, SHIFTED * spread), off, 0.0)
    if not off.any():
        return None
    head, slot = np.unravel_index(int(np.argmax(off)), off.shape)
    added = low[head, slot] if abs(low[head, slot] - stated[head, slot]) >= abs(high[head, slot] - stated[head, slot]) \
        else high[head, slot]
    return int(head), int(slot) - stated.shape[1] // 2, float(stated[head, slot]), float(added)


def misplaced(run: Run) -> list:
    """(call, Finding) for the first step of each site whose bias is not the function of k - q its full pass states."""
    found, said = [], set()
    for where, calls in run.sites().items():
        stated = head = None
        for call in calls:
            bias = call.details.get("position_bias")
            if not bias or not ("own_start" in bias or _end_aligned(run, call)):  # (a static cache's step: its
                # queries at their last kept key, trace/posbias.py)
                continue
            q_len, k_len = call.shape[2:]
            full = q_len >= 2 and (q_len == k_len or bias.get("own_start") == 0)  # (a static cache's prefill: its
            if stated is None:  # queries the first slots, those past them unwritten)
                if full:
                    stated, head = _stated(bias), call
                continue
            worst = _worst(*stated, bias)
            if worst is not None and full:
                break  # (another full pass adds another bias: not one function of k - q, XLNet's content term)
            if worst is None:
                continue
            h, d, want, got = worst
            slip = (head.step, call.step, h, d, f"{want:.4g}", f"{got:.4g}")
            first = bias.get("own_start", k_len - q_len)  # (its first query's key)
            if slip in said:
                break  # (the layers of one model, each the same slip: said at the first)
            said.add(slip)
            found.append((call, Finding("position-bias-misplaced", (
                f"step {head.step} of {where} adds a bias that is one function of the key's distance from the query "
                f"(head {h}: {want:.4g} at distance {d}, each row less its value at its own key), but at step {call.step} "
                f"({f'its query at position {first}' if q_len == 1 else f'queries at {first}..{first + q_len - 1}'} of {k_len} "
                f"keys) "
                f"it adds {got:.4g} there: its bias rows are not its queries' own ("
                + ("it adds the same value at every distance: a bias built over the step's own tokens, not the keys "
                   "it sees? or the rows of the first queries, as alibi[:, :q_len] gives" if "zero" in bias else
                   "a cached step given the rows of the first queries, as alibi[:, :q_len] does; take the last: "
                   "alibi[:, -q_len:]") + ")"),
                expected=f"the bias of step {head.step} at each distance k - q", source=f"{where} at steps {head.step} "
                f"and {call.step}", cell=(0, first, first + d))))
            break  # (each site said once)
    return found


RULES = (
    Rule("position-bias-misplaced", "wrong", "site", "a call site whose relative-position bias (ALiBi, buckets) at a "
         "cached step is not the function of k - q its full pass adds (TransformerLens#777: alibi[:, :query_ctx] at "
         "decode, row 0 for the query at position p)", misplaced),
)
