"""Scores of one tile of a larger attention: q @ kᵀ over a slice of the rows, queries or keys the program holds whole.

A blockwise kernel written in the program splits its query and key tensors and runs one softmax (or one sum of
exponentials) per (query chunk, key chunk) pair, adding the pieces up (memory-efficient-attention-pytorch's
`q.split(q_bucket_size, dim=-2)` / `k.split(k_bucket_size, dim=-2)`; reformer-pytorch's `x.chunk(attn_chunks,
dim=0)` of the batch folded with its heads). Each chunk is a view of the tensor it was split from: its storage offset
says where it starts. Where the scores' query operand (.., Lq, D) or key operand (.., Lk, D) is such a view, shorter
on its batch, query or key axis than the base axis of the same stride, the call records "tile" = [[batch start, batch
total], [query start, query total], [key start, key total]] (whole axes as [0, size]): its rows, queries and keys are
those of the whole. Read off sizes, strides and storage offsets only; nothing is copied, no torch function is called.
"""

from __future__ import annotations

import torch


def _span(t, axis: int) -> tuple[int, int] | None:
    """(start, total) of `t` along `axis` where it is a proper slice of what its base holds at that stride; (0, size)
    where whole or where its base holds no axis of that stride (a view that split it); None where it does not fit.
    The base's axes of that stride and the next ones it merges into (stride times size, as a batch folded with its
    heads, `(b h)`) count as one, up to a stride another axis of `t` has (its heads, its batch: not this axis's)."""
    base = t._base
    size, stride = int(t.shape[axis]), int(t.stride(axis))
    if base is None or size < 1 or stride == 0:
        return 0, size
    axes = {int(s): int(n) for n, s in zip(base.shape, base.stride()) if int(n) > 1}
    others = {int(s) for i, s in enumerate(t.stride()) if i != axis and int(t.shape[i]) > 1}
    if stride not in axes:
        return 0, size  # (no axis of its base at that stride: read as whole)
    whole = axes[stride]
    while stride * whole in axes and stride * whole not in others:
        whole *= axes[stride * whole]
    inside = [other for other in others if stride < other < stride * whole]
    if inside and all(other % stride == 0 for other in inside):
        whole = min(inside) // stride  # (a base axis that merges this one with an outer one of `t`: a Linear's
        # (B * L, features) output viewed (B, L, ...), its batch an axis of `t`)
    elif inside:
        return 0, size
    if whole <= size:
        return 0, size  # (whole, or blocks of it cut by another axis: local-attention's windows, no slice)
    start = ((int(t.storage_offset()) - int(base.storage_offset())) // stride) % whole
    return (start, whole) if start + size <= whole else None


def _sample(t, axis: int) -> tuple[int, int] | None:
    """(index, count) where `t`'s `axis` is the whole of its base's axis of that stride at one index of the base's next
    axis out, one `t` does not have (indexed away: `q[i]` of a (B, L, H, D) projection, a loop over the batch handing
    the kernel one sample's heads, tunix's vmapped splash kernel): the call's rows are that sample's, its queries (or
    keys) all of its own; None where it is no such index."""
    base = t._base
    size, stride = int(t.shape[axis]), int(t.stride(axis))
    if base is None or size < 2 or stride == 0:
        return None
    axes = {int(s): int(n) for n, s in zip(base.shape, base.stride()) if int(n) > 1}
    others = {int(s) for i, s in enumerate(t.stride()) if i != axis and int(t.shape[i]) > 1}
    outer = stride * size
    if axes.get(stride) != size or outer not in axes or outer in others:
        return None
    offset = int(t.storage_offset()) - int(base.storage_offset())
    return (offset // outer) % axes[outer], axes[outer]


def _sample_of(q, k, axis: int) -> tuple[int, int] | None:
    """(i, B) where q (.., Lq, D) and k (its positions on `axis`) are sample i of B's own (_sample, the same index of
    both), q's leading axis whole (that sample's heads); None else."""
    one = _sample(q, q.dim() - 2)
    return one if one is not None and one == _sample(k, axis) and _span(q, 0) == (0, int(q.shape[0])) else None


def one_sample(q, k) -> list | None:
    """[[i, B], [0, Lq], [0, Lk]] where SDPA's 3-D q (H, Lq, D) and k (H, Lk, D) are one sample's heads, sample i of B
    (_sample_of): the call's one row (its heads on the heads axis) is sample i of the batch; None else."""
    try:
        one = None if q._base is None or k._base is None else _sample_of(q, k, k.dim() - 2)
        return None if one is None else [list(one), [0, int(q.shape[-2])], [0, int(k.shape[-2])]]
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def tile(q, k, turned: bool = False) -> list | None:
    """[[b0, B], [q0, Q], [k0, K]] of q @ kᵀ (q (.., Lq, D), k (.., Lk, D), or kᵀ (.., D, Lk) where `turned`) where one
    axis is a proper slice; None else."""
    try:
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 3 or k.dim() < 3 \
                or q._base is None and k._base is None:
            return None
        axis = k.dim() - (1 if turned else 2)
        one, rows = _sample_of(q, k, axis), int(q.shape[0])  # (one sample's rows: batch-major, its queries and keys whole)
        spans = [(one[0] * rows, one[1] * rows), (0, int(q.shape[-2])), (0, int(k.shape[axis]))] if one is not None \
            else [_span(q, 0), _span(q, q.dim() - 2), _span(k, axis)]
        if any(each is None for each in spans) or all(start == 0 and total == n for (start, total), n in
                                                       zip(spans, (q.shape[0], q.shape[-2], k.shape[axis]))):
            return None
        return [list(each) for each in spans]
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # (tensor subclasses: no view to read)
        return None
