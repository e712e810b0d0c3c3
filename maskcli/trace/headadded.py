"""A 0/1 tensor added to the scores that is one constant per (batch row, head): the softmax cancels it (checks/headadded.py).

scores.py keeps, with the scores it follows, a float addend of only 0s and 1s (`_zero_one`). Where that addend holds
one value along the queries and the keys of each (row, head) of 4-D (B, H, Lq, Lk) scores and differs between the
heads of some row, it states a choice of heads (a head mask: 1 keeps a head, 0 prunes it, or the other way round), and
adding it shifts each softmax row by a constant: every head attends exactly as without it (PrunaAI/pruna#537:
`attn_weights + head_mask`, a (1, H, 1, 1) mask). Read at the softmax, from the addend's own (small) shape.
"""

from __future__ import annotations

import torch


def heads_apart(addend: torch.Tensor, scores: torch.Tensor) -> dict | None:
    """{"row", "ones", "zeros", "heads"} of the first batch row whose heads the 0/1 `addend` (bool: where it adds 1)
    sets apart while adding one value along each head's queries and keys; None for any other addend."""
    if scores.dim() != 4 or addend.dim() > 4:
        return None
    with torch.no_grad():
        ones = addend.reshape((1,) * (4 - addend.dim()) + tuple(addend.shape))
        if ones.shape[1] != scores.shape[1] or ones.shape[1] < 2:
            return None  # (no head axis of its own: not a choice of heads)
        if not bool((ones == ones[..., :1, :1]).all()):
            return None  # (differs along the queries or keys: a mask of cells, ones-added's)
        per_head = ones[:, :, 0, 0]
        apart = per_head.any(dim=1) & ~per_head.all(dim=1)
        if not bool(apart.any()):
            return None
        row = int(apart.nonzero()[0, 0])
        marks = per_head[row].tolist()
        return {"row": row if per_head.shape[0] > 1 else None, "heads": len(marks),
                "ones": [h for h, one in enumerate(marks) if one], "zeros": [h for h, one in enumerate(marks) if not one]}
