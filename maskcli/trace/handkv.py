"""Keys zero in K and V behind a softmax written by hand: q @ kᵀ's operands kept, weakly, to the product with V.

trace/zerokv.py reads an SDPA call's K and V for keys exactly zero at an edge of the keys (a buffer row nobody wrote).
A program that writes attention by hand never hands one function its K and V: q @ kᵀ makes the scores (its q and kᵀ
kept here beside them, each as a weak reference to the tensor it views with its strides, carried with the scores by
trace/scores.py), the softmax the weights, and weights @ V the output. At that product (trace/weights.py) the
softmax's call reads zerokv.zero_kv of q, K and V, each viewed (B, heads, L, D) with any group axes folded into the
heads (no copy: a layout that cannot be viewed so is not read), and records details["zero_kv"] as an SDPA call does
(its runs of keys zero in every head; not those of one head alone: the second axis of scores by hand may be windows
or buckets, not heads), where it holds none yet (skyzh/tiny-llm's continuous batching before ae06a7f: a zero-filled
ring row per request, read whole at each decode step with mask=None). Nothing is kept alive; where no edge key is
zero, zerokv's first test (a few cells read) is all it costs.
"""

from __future__ import annotations

import weakref

import torch

from maskcli.trace.zerokv import zero_kv


def keyed(found: dict, out: torch.Tensor, operands) -> None:
    """Keep q and kᵀ of scores `out` = q @ kᵀ (Scores.keyed, by id; cleared with the scores): each as a weak
    reference to the tensor it views (kᵀ is most often a temporary `k.transpose(-2, -1)`, gone before weights @ V;
    the K it views lives on) with its sizes, strides and offset, to be viewed again (_again)."""
    try:
        found[id(out)] = tuple(_kept(t) for t in operands)
    except (TypeError, RuntimeError):  # (a tensor subclass without weak references, no strides: not kept)
        pass


def _kept(t: torch.Tensor) -> tuple:
    base = t._base if t._base is not None else t
    return weakref.ref(base), tuple(t.shape), t.stride(), t.storage_offset()


def _again(kept: tuple) -> torch.Tensor | None:
    """The tensor _kept kept, viewed again on its base (None where the base is gone)."""
    base = kept[0]()
    if base is None:
        return None
    try:
        return base.as_strided(kept[1], kept[2], kept[3])
    except RuntimeError:  # (a base resized since: not read)
        return None


def _as_heads(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`t` (rows or 1, ..., L, D) viewed (rows or 1, heads, L, D); None where it cannot be without a copy."""
    if t.dim() == 4:
        return t
    if t.dim() < 4 or t.shape[0] not in (1, rows):
        return None
    try:
        return t.view(t.shape[0], -1, t.shape[-2], t.shape[-1])
    except RuntimeError:  # (a layout that needs a copy: not read)
        return None


def values(call, refs: tuple, v, keep=None) -> None:
    """At the product of `call`'s weights with `v`: details["zero_kv"] of its q, K and V (zerokv.zero_kv), where the
    call holds none and the operands are still alive and fit its shape. `keep`: the call's bool (B, H, Lq, Lk) cells
    kept, as an SDPA call's mask: the runs are read from the edges of the keys some query keeps (masked padding is
    not read)."""
    if "zero_kv" in call.details or not isinstance(v, torch.Tensor):
        return
    q, kt = _again(refs[0]), _again(refs[1])
    rows, _, q_len, k_len = call.shape
    if q is None or kt is None or kt.shape[-1] != k_len or v.shape[-2] != k_len or q.shape[-2] != q_len:
        return
    q, k, v = (_as_heads(t, rows) for t in (q, kt.transpose(-1, -2), v))
    if q is None or k is None or v is None or q.shape[0] != rows or k.shape[-1] != q.shape[-1]:
        return
    kept = keep if isinstance(keep, torch.Tensor) and keep.dim() == 4 else None
    found = zero_kv(q, k, v, tuple(k.shape), kept).get("zero_kv")
    if found is not None:  # (keys zero in every head only: a softmax by hand may fold other axes than heads into its
        found.pop("heads", None)  # second, lucidrains' local-attention windows, whose padded tail is one window's)
        call.details["zero_kv"] = found
