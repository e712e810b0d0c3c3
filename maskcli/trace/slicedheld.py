"""A square mask over a sequence's tokens that the program holds, handed to the attention as a window of itself.

A program builds one (B, L, L) mask over its tokens (a tokenizer's causal and padding mask) and hands its model a
slice of it for a shorter run (the inputs without their last token: `attention_mask[:, :-1, :-1]`). held.py drops a
mask a caller holds when the function that made the call was handed a mask of its own (another call's, as an
encoder-decoder's); where that handed mask is a view into the held one (same storage, the same row and column
strides), it is the held mask's window, and where it begins, rows and columns, is exact: its storage offset. Kept
only where the window's rows begin elsewhere than its columns (EasyTPP's THP sliced `[:, 1:, :-1]`): as kind
"sliced", moved by held.split_top to details["held_sliced"] (checks/slicedmask.py).
"""

from __future__ import annotations

import torch


def views(frame, outer: list, handed) -> list[dict]:
    """Reads of kind "sliced" ({name, where, rows (B, L, L), offsets (row, column, size)}) of each held square mask in
    `outer` ((read, tensor) pairs) that a mask handed to `frame`'s function (its arguments named as `handed` matches)
    is a window of, its rows and columns begun at different tokens."""
    code, variables = frame.f_code, frame.f_locals
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    own = [variables[name] for name in arguments if handed.search(name) and isinstance(variables.get(name), torch.Tensor)]
    found = []
    for read, base in outer:
        for mask in own:
            where = _window(mask, base)
            if where is not None and where[0] != where[1]:
                found.append({"kind": "sliced", "name": read["name"], "where": read["where"], "rows": read["rows"],
                              "offsets": where})
                break
    return found


def _window(mask: torch.Tensor, base: torch.Tensor) -> tuple[int, int, int] | None:
    """(first row, first column, size) of the square window of `base` (B, L, L), contiguous, that `mask` (..., n, n)
    views, every batch row of it; None where it views none."""
    if base.dim() != 3 or base.shape[1] != base.shape[2] or mask.dim() < 3 or mask.shape[-1] != mask.shape[-2] \
            or mask.shape[0] != base.shape[0] or mask.dtype != base.dtype:
        return None
    try:
        if mask.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or not base.is_contiguous():
            return None
    except (RuntimeError, NotImplementedError, TypeError):  # (a tensor with no storage of its own: fake, functional)
        return None
    length, size = base.shape[-1], mask.shape[-1]
    if mask.stride()[0] != base.stride()[0] or mask.stride()[-2:] != base.stride()[-2:] or not 1 < size < length:
        return None
    offset = mask.storage_offset() - base.storage_offset()
    if not 0 <= offset < length * length:
        return None
    row, column = divmod(offset, length)
    return (row, column, size) if row + size <= length and column + size <= length else None
