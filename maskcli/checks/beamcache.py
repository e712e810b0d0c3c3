"""A decoder's layers that disagree on which earlier hypothesis each batch row continues: a cache left in its old order.

A beam search decodes B x N hypotheses as rows; after each step its top-k picks which hypothesis each row continues
(`index_select(hyps, 0, best_hyps_index)`), and every layer's cache must be reordered the same way, or a row's new
token attends to the cached states of another hypothesis. A decoder that recomputes its first layer from the whole
token prefix each step (WeNet's and ESPnet's `forward_one_step`: the tokens embedded again, each later layer given its
cached outputs) states the new order itself: its first layer's keys of row r are those the step before gave the
hypothesis row r now continues. A later layer whose cache was left alone (wenet#1635: the fix index_selects every
layer's cache with `base_cache_index + offset_k_index // beam_size`) holds row r's keys of the step before, another
hypothesis's.

Read at the decode steps of sibling self-attention sites (one site per layer, the same path but for its layer
number), one query per row, as trace/keyrows.py records them (head 0's keys, one number per row and key). For each site
and step, each row's earlier keys (all but the last, the step's own) are looked up among the keys of the same site's
step before: the rows of that step whose keys they are (several where hypotheses share their prefix). Where two sibling
sites of one step find row r's earlier keys in disjoint sets of rows, the layers disagree on which hypothesis row r
continues: *wrong*, said at the site whose keys are still row r's own of the step before (the cache left in the old
order). Quiet where every layer agrees (a cache reordered with its hypotheses, a greedy batch that reorders nothing,
every layer cached and none recomputed: nothing states the order), where a row's keys are found at no row of the step
before (a prefix recomputed otherwise), on cross-attention, and where the rows or keys do not grow by one key a step.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import LAYER, Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding

RTOL = 1e-4  # relative to the site's largest key number: the same keys computed over a shorter prefix (float32)


def _continues(before: np.ndarray, now: np.ndarray) -> np.ndarray | None:
    """Bool (B, B): [r, s] where row r's earlier keys now are row s's keys of the step before; None where not read."""
    if before.shape[0] != now.shape[0] or now.shape[1] != before.shape[1] + 1:
        return None
    earlier = now[:, :-1]
    tol = RTOL * max(float(np.abs(before).max(initial=0.0)), float(np.abs(earlier).max(initial=0.0)), 1e-12)
    return (np.abs(earlier[:, None, :] - before[None, :, :]) <= tol).all(axis=2)


def cache_not_reordered(run: Run) -> list:
    """Decode steps whose sibling self-attention sites find a row's earlier keys at disjoint rows of the step before."""
    sites: dict = {}
    for call in [*run.calls, *run.unmasked]:  # (a decode step of one query masks nothing: engine.py calls it unmasked)
        rows = call.details.get("key_rows")
        if rows is not None and call.shape[2] == 1 and not cross(call):
            sites.setdefault(call.where, []).append(call)
    steps: dict = {}
    for where, calls in sites.items():
        calls.sort(key=lambda call: call.index)
        for before, now in zip(calls, calls[1:]):
            seen = _continues(before.details["key_rows"], now.details["key_rows"])
            if seen is not None:
                family = LAYER.sub(".#.", where)
                steps.setdefault((family, now.step, now.shape[0], now.shape[3]), []).append((now, before, seen))
    found, said = [], set()
    for key in sorted(steps, key=lambda key: min(now.index for now, _, _ in steps[key])):
        layers = steps[key]
        for r in range(key[2]):
            hit = _disagree(layers, r)
            if hit is not None and hit[0].where not in said:
                said.add(hit[0].where)
                found.append((hit[0], _finding(*hit, r)))
                break
    return found


def _disagree(layers: list, r: int) -> tuple | None:
    """(the stale site's call, its step before, the other site's call, a row the other says r continues) where two
    sites find row r's earlier keys at disjoint rows; the stale one is the site that finds them at row r itself."""
    live = [(now, before, seen[r]) for now, before, seen in layers if seen[r].any()]
    for now, before, rows in live:
        for other, _, theirs in live:
            if other is not now and not (rows & theirs).any() and rows[r] and not theirs[r]:
                return now, before, other, int(np.flatnonzero(theirs)[0])
    return None


def _finding(now, before, other, s: int, r: int) -> Finding:
    keys_now, keys_before = now.details["key_rows"][r, :-1], before.details["key_rows"][s]
    tol = RTOL * max(float(np.abs(keys_before).max(initial=0.0)), 1e-12)
    k = int(next(iter(np.flatnonzero(np.abs(keys_now - keys_before) > tol)), 0))
    return Finding("cache-not-reordered", (
        f"at decode step {now.step} batch row {r}'s earlier keys in {other.where} are those row {s} had at the step "
        f"before (that layer follows the hypotheses as reordered: row {r} now continues row {s}'s), "
        f"but in {now.where} they are still row {r}'s own of the step before: from key {k} on, row {r}'s new token "
        f"attends to cached states of another hypothesis (the cache was not reordered with the hypotheses the beam "
        f"search selected)"),
        expected=f"row {r}'s cached keys those of row {s} at the step before, as in {other.where}",
        source=f"{other.where} at step {other.step}", cell=(r, 0, k))


RULES = (
    Rule("cache-not-reordered", "wrong", "steps", "a decode step whose layers disagree on which earlier hypothesis a "
         "batch row continues: one recomputed from the reordered tokens, another's cache left in the old beam order "
         "(wenet#1635: the decoder cache not index_selected after the beam search's top-k)", cache_not_reordered),
)
