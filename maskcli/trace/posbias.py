"""A float bias added to a softmax's scores, read as a function of the key's distance from the query (ALiBi, T5's buckets).

A relative-position bias depends on k - q alone, up to one constant per query row (softmax is shift-invariant: Bloom's
ALiBi adds slope * k, TransformerLens's slope * min(k - q, 0)). Scores.after keeps the float tensors added to scores
(`scores + bias`, `scores += bias`: no copy, a reference each) and carries them to what is computed from those scores;
at the softmax, `profile` reads the bias on the cells the call's mask keeps, each query row normalised at its own
column, with the queries placed at the end of the keys (a cache's offset, Lk - Lq: query i at column Lk - Lq + i), per
head: per distance d = k - q within DISTANCE, the least and the greatest value seen over batch rows and query rows.
checks/relbias.py compares a site's steps. Nothing of the bias is read at the add: the cost is at the softmax, bounded
by MOST cells.
"""

from __future__ import annotations

import numpy as np
import torch

DISTANCE = 32  # distances d = k - q read each way
MOST = 1 << 20  # cells of a softmax's scores read at most
ADDENDS = 3  # float tensors carried per scores tensor at most


def addend(args: tuple, scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """The other operand of scores + bias where it is a float tensor over (Lq or 1, Lk or 1) that broadcasts to the sum,
    and holds a plane per head where it has a head axis (a mask over (B, 1, Lq, Lk), as HF's eager paths add, is no
    bias: not read). One value a query row for every key is a bias too, of no distance (deep_training's Baichuan
    sliced its ALiBi on the key axis at decode: a (heads, 1, 1) column added, the distances lost)."""
    if len(args) != 2:  # (add(x, y, alpha=...): not a plain sum)
        return None
    other = args[1] if args[0] is scores else args[0]
    if not isinstance(other, torch.Tensor) or other is scores or not other.is_floating_point() or other.dim() < 2 \
            or other.dim() >= 3 and other.shape[-3] == 1 < out.shape[-3] \
            or other.shape[-1] not in (1, out.shape[-1]) or other.shape[-2] not in (1, out.shape[-2]) \
            or other.device.type == "meta" or other.numel() > MOST:
        return None
    return other.detach()


def carried(held: dict, had: tuple, out: torch.Tensor, new: torch.Tensor | None) -> None:
    """`out`, computed from scores to which `had` was added, keeps `had`, and `new` (added now) beside it."""
    if new is not None and len(had) < ADDENDS:
        had = (*had, new)
    if had:
        held[id(out)] = had


def profile(addends: tuple, x: torch.Tensor, keep: torch.Tensor | None) -> dict | None:
    """{"heads", "low", "high", "count"} (low and high: per head, per distance -DISTANCE..DISTANCE, the least and
    greatest bias seen there, each query row less its value at its own column, None where no kept cell lies at that
    distance; count: the cells seen there, over query rows and batch rows), or
    {"heads", "zero": [least, greatest distance]} where it is 0 on every kept cell, or None where there is nothing to
    read (no mask read, too many cells, no kept cell within DISTANCE)."""
    if keep is None or x.dim() < 3 or x.numel() > MOST:
        return None
    q_len, k_len = x.shape[-2:]
    try:
        bias = sum(a.to(torch.float64).broadcast_to(x.shape) for a in addends).reshape(-1, q_len, k_len)
        kept = keep.broadcast_to(x.shape).reshape(-1, q_len, k_len)
    except RuntimeError:
        return None
    bias, kept = bias.cpu().numpy(), kept.cpu().numpy()
    heads = x.shape[1] if x.dim() == 4 else bias.shape[0]
    own = np.arange(q_len) + (k_len - q_len)  # each query's own column: the keys end at the last query
    if own[0] < 0:
        return None
    static = _static_columns(kept, own)  # (a static cache's queries: at their last kept key, the slots after unwritten)
    own = own if static is None else static
    rows = np.arange(q_len)
    real = kept[:, rows, own]  # (planes, Lq): rows whose own key is kept (padding queries are not)
    with np.errstate(invalid="ignore"):  # (-inf less -inf on a masked own column: NaN, read as no cell)
        g = bias - bias[:, rows, own][:, :, None]
    distance = np.arange(k_len)[None, :] - own[:, None]  # (Lq, Lk)
    near = np.abs(distance) <= DISTANCE
    cells = kept & real[:, :, None] & near[None] & np.isfinite(g)
    if not cells.any():
        return None
    plane, row, col = np.nonzero(cells)
    if not np.abs(g[cells]).max() > 0:  # (a mask added, 0 on every kept cell; or a bias lost: the distances it spans)
        return {"heads": int(heads), "zero": [int(distance[row, col].min()), int(distance[row, col].max())],
                **({} if static is None else {"own_start": int(own[0])})}
    slot = (plane % heads) * (2 * DISTANCE + 1) + distance[row, col] + DISTANCE
    values = g[plane, row, col]
    low = np.full(heads * (2 * DISTANCE + 1), np.inf)
    high = np.full(heads * (2 * DISTANCE + 1), -np.inf)
    np.minimum.at(low, slot, values)
    np.maximum.at(high, slot, values)
    count = np.bincount(slot, minlength=low.size).reshape(heads, -1)
    return {"heads": int(heads), "low": _listed(low, heads), "high": _listed(high, heads), "count": count.tolist(),
            **({} if static is None else {"own_start": int(own[0])})}


def _static_columns(kept: np.ndarray, own: np.ndarray) -> np.ndarray | None:
    """Each query's own column in a static cache (keys preallocated, the slots past the queries not yet written): the
    last key any plane keeps in its row, where those are consecutive, before the keys' end, and no plane keeps a key
    after the last query's (KerasHub's cached Falcon: a (B, H, 1, max_length) step at `cache_update_index`); None
    where the queries sit at the keys' end (or the mask keeps keys past them)."""
    seen = kept.any(axis=0)  # (Lq, Lk)
    if not seen.any(axis=1).all():
        return None
    last = seen.shape[1] - 1 - np.argmax(seen[:, ::-1], axis=1)
    if (last >= own).any() or (np.diff(last) != 1).any():
        return None
    return last


def _listed(values: np.ndarray, heads: int) -> list:
    return [[None if not np.isfinite(v) else round(float(v), 6) for v in row] for row in values.reshape(heads, -1)]


def bias_of(held: dict, has, x, call, seen) -> None:
    """At softmax `call` over scores `x`: details["position_bias"], the profile of what was added to them."""
    addends = held.get(id(x)) if isinstance(x, torch.Tensor) and has(x) else None
    if not addends or "axes" in seen.details:
        return
    keep = seen.keep if seen.keep is not None else seen.materialize()
    found = profile(addends, x.detach(), keep)
    if found is not None:
        call.details["position_bias"] = seen.details["position_bias"] = found
        # (the addends' own shapes: which axis of the scores their planes broadcast onto, checks/biaswindows.py)
        call.details["bias_shapes"] = seen.details["bias_shapes"] = [list(a.shape) for a in addends]
