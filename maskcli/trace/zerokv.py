"""Keys whose K and V are exactly zero at an edge of an SDPA call's key axis: the data's own padding.

A key row that is zero in every head and every dimension of both K and V is not a token: it is a buffer row nobody
wrote (whisper.cpp's K/V views of GGML_PAD(n_ctx, 256) rows, only n_ctx written) or a padding position whose input
was zeros, through projections without a bias (LLaVA's re-padded image+text embeddings; any `nn.Embedding` row of
its `padding_idx` under a bias-free projection). Recorded per batch row as the length of the run of such keys at the
start and at the end of the keys, and the query rows that are zero too (padding queries themselves); checks/zerokv.py
says where real queries see them.

Cheap where there is nothing to find: the first dimension of the first and last key of every row and head is looked
at (a few microseconds a call). Where one is zero, each key's first dimension in every head says which may be zero
(one element a key and head: a static cache of a million slots is not read in its every dimension at each step),
and the first and last key of each run at an edge are read whole, in K and in V; a run whose ends are not zero is
none.
"""

from __future__ import annotations

import numpy as np
import torch

SPANS = 64  # zero query spans kept per batch row (more: the row is left out, as unread)


def zero_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape: tuple) -> dict:
    """{"zero_kv": {"left": [..], "right": [..], "zero_q": [[[start, end], ...], ...]}} per batch row (call.shape[0]
    rows, or 1 where K's batch is broadcast), or {} where no edge key is zero in K and V. `k_shape`: K's shape, read
    once by the caller."""
    if not 3 <= len(k_shape) <= 4 or k_shape[-2] < 3:
        return {}
    try:
        if not _edge_may_be_zero(k, k_shape[-2]) or not (k.dim() == v.dim() == q.dim()) or k.is_nested \
                or v.shape[-2] != k_shape[-2]:
            return {}
        with torch.no_grad():
            zero = (_first(k) & _first(v)).cpu()  # (B, Lk): candidates, from each key's first dimension
            length = zero.shape[1]
            left = torch.where(zero.all(dim=1), length, (~zero).int().argmax(dim=1)).tolist()
            right = torch.where(zero.all(dim=1), length, (~zero).flip(1).int().argmax(dim=1)).tolist()
            rows = k.shape[0] if k.dim() == 4 else 1
            for b in range(len(left)):  # each run's first and last key read in every dimension: else no run
                for side, run in (("left", left[b]), ("right", right[b])):
                    ends = (0, run - 1) if side == "left" else (length - run, length - 1)
                    if run >= 2 and not all(_whole(t, b % rows if t.dim() == 4 else None, at) for t in (k, v)
                                            for at in ends):
                        (left if side == "left" else right)[b] = 0
            if max(max(left), max(right)) < 2:
                return {}
            zero_q = _first(q).cpu()  # (a real query's first dimension 0 in every head only makes the rule quieter)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, compiled, meta, sparse) holds no padding we can see
        return {}
    return {"zero_kv": {"left": left, "right": right, "zero_q": [_spans(row) for row in zero_q]}}


def _first(t: torch.Tensor) -> torch.Tensor:
    """Bool (B, L): the rows of (B, H, L, E) or (H, L, E) (one batch row) whose first dimension is 0 in every head
    (one element a row and head read: a cache of a million slots is read once, not its every dimension)."""
    zero = t[..., 0] == 0
    return zero.all(dim=1) if t.dim() == 4 else zero.all(dim=0)[None]


def _whole(t: torch.Tensor, b: int | None, at: int) -> bool:
    """Whether key `at` of batch row `b` (None: a (H, L, E) tensor) is 0 in every head and dimension."""
    row = t[b, :, at] if b is not None else t[:, at]
    return not bool(row.any())


_NUMPY = (torch.float32, torch.float64, torch.float16)


def _edge_may_be_zero(k: torch.Tensor, length: int) -> bool:
    """Whether the first or the last key of some row and head is 0 in its first dimension (a key zero in every
    dimension is): on the CPU read through numpy (about two microseconds; torch's ops cost several each)."""
    if k.is_cpu and k.dtype in _NUMPY:
        ends = (k.detach() if k.requires_grad else k).numpy()[..., :: length - 1, 0]
        return np.count_nonzero(ends) < ends.size
    with torch.no_grad():
        return bool((k[..., :: length - 1, 0] == 0).any())


def _spans(row: torch.Tensor) -> list | None:
    """[[start, end), ...] of the True runs of a 1-D bool tensor; None past SPANS runs."""
    if not bool(row.any()):
        return []
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    change = torch.nonzero(padded[1:] != padded[:-1]).flatten()
    if change.numel() > 2 * SPANS:
        return None
    change = change.tolist()
    return [change[i:i + 2] for i in range(0, len(change), 2)]
