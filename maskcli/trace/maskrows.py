"""A mask handed to the kernel as a block of rows of a longer square mask the program holds (checks/maskrows.py).

A context-parallel rank (Llama 3's all-gathered keys and values) attends its own shard's Lq queries to all L keys,
with the rows of the full (L, L) mask that belong to its queries: `attention_mask[:, :, start:start + Lq, :]`. Where the
kernel's mask is such a view (the same strides and sizes as its base but on the query axis, the base's last two axes
L x L with L the call's keys), the call records under "mask_rows_of" (the base's serial, the first row taken, L,
whether another block of Lq rows of the base differs from the one taken): two calls with the same serial sliced the
same tensor, and the rows a call took are the rows of its queries only where its queries sit there. Read off the
view's sizes, strides and storage offset, and one comparison of row blocks; nothing else is copied.
"""

from __future__ import annotations

import torch

from maskcli.trace.queried import query_tensor


def note(details: dict, mask, k_len: int) -> None:
    """details["mask_rows_of"] = (serial, start, L, differs) where `mask` is a block of rows of a square (.., L, L)
    base over the call's L keys."""
    try:
        if not isinstance(mask, torch.Tensor) or mask._base is None or mask.dim() < 2:
            return
        base = mask._base
        if base.dim() < 2 or tuple(base.shape[-2:]) != (k_len, k_len):
            return
        shape, stride, n = tuple(mask.shape), tuple(mask.stride()), int(mask.shape[-2])
        lead = [(int(a), x) for a, x in zip(shape[:-2], stride[:-2]) if int(a) > 1]  # (axes of size 1 added or kept:
        # `mask[None, None]`, `[:, None]`, say nothing)
        if n < 2 or n >= k_len or shape[-1] != k_len or stride[-2:] != tuple(base.stride()[-2:]) \
                or lead != [(int(a), x) for a, x in zip(base.shape[:-2], base.stride()[:-2]) if int(a) > 1]:
            return
        start, left = divmod(int(mask.storage_offset()) - int(base.storage_offset()), int(base.stride(-2)) or 1)
        if left or start < 0 or start + n > k_len:
            return
        rows = mask.reshape(-1, n, k_len)
        differs = any(not torch.equal(rows, base.narrow(-2, s, n).reshape(-1, n, k_len))
                      for s in range(0, k_len - n + 1, n) if s != start)
        details["mask_rows_of"] = (query_tensor(base)[0], start, k_len, differs)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # (tensor subclasses: no view to read)
        return
