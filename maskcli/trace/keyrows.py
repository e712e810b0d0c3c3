"""Which earlier hypothesis each batch row's cached keys belong to: one number per row and key of a decode step.

A beam search (or any batch decode that reorders its rows: top-k picks which hypothesis each row continues) must
reorder every layer's cache with its hypotheses. A layer whose keys are recomputed from the reordered tokens states the
new order; a layer whose cache was left alone keeps the old one (wenet#1635). To see it, a decode step's keys are read
as one fingerprint per (batch row, key): head 0's key vector dotted with a fixed vector (`key_rows`, float32 (B, Lk)),
which the rule compares with the same site's previous step (checks/beamcache.py).

Cheap: read only at a call of one query over 4-D keys (B, H, Lk, D) of two batch rows or more and two keys or more, on
the CPU, float32/float64, of at most MOST elements in head 0 and KEPT keys over the rows (a batch of short hypotheses,
not a long cache: what each call keeps stays small); one matrix-vector product over head 0 and nothing per token. The softmax path reads it off q @ kᵀ (trace/scores.py carries
it to the softmax), SDPA off its key argument (trace/keyreads.py).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.hostview import host

MOST = 1 << 16  # elements of head 0's keys read at most (B * Lk * D)
KEPT = 2048  # numbers kept per call at most (B * Lk: a batch of short hypotheses; float32, 8 KiB)
_WEIGHTS: dict[tuple, np.ndarray] = {}


def _weights(width: int, dtype) -> np.ndarray:
    """A fixed vector per key width, in the keys' own dtype (its own generator: the program's random state is left
    alone; the keys read as they are, no copy: a few microseconds a call)."""
    key = (width, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = np.random.default_rng(width + 1635).standard_normal(width).astype(dtype)
    return _WEIGHTS[key]


def key_rows(k: torch.Tensor, turned: bool = False) -> np.ndarray | None:
    """float32 (B, Lk): head 0's keys of each row dotted with a fixed vector; None where the call is not one to read.
    `turned`: `k` is kᵀ (B, H, D, Lk), the second operand of q @ kᵀ."""
    try:
        if type(k) is not torch.Tensor or k.dim() != 4 or not k.is_cpu or k.dtype not in (torch.float32, torch.float64):
            return None
        b, _, a, c = k.shape
        n, d = (c, a) if turned else (a, c)
        if b < 2 or n < 2 or b * n * d > MOST or b * n > KEPT:
            return None
        head = host(k)[:, 0]
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states nothing
        return None
    weights = _weights(d, head.dtype)
    rows = np.einsum("bdn,d->bn", head, weights) if turned else head @ weights
    return rows.astype(np.float32, copy=False)


def sdpa_rows(q_shape: tuple, k: torch.Tensor) -> dict:
    """{"key_rows": ...} at an SDPA call of one query (a decode step), else {}."""
    if len(q_shape) != 4 or q_shape[-2] != 1:
        return {}
    found = key_rows(k)
    return {} if found is None else {"key_rows": found}


def noted(found: dict, out: torch.Tensor, rows: np.ndarray | None) -> None:
    """Keep `rows` for scores `out` (Scores.keyrows, by id; at most KEEP: all forgotten past it)."""
    if rows is not None:
        if len(found) >= 256:
            found.clear()
        found[id(out)] = rows


def of(scores, x, call, seen) -> None:
    """At softmax `call` over scores `x`: details["key_rows"] where their kᵀ was read (Scores.keyrows)."""
    rows = scores.keyrows.get(id(x)) if isinstance(x, torch.Tensor) and scores.has(x) else None
    if rows is not None and "axes" not in seen.details and tuple(rows.shape) == (call.shape[0], call.shape[3]):
        call.details["key_rows"] = rows
