"""The batch-major fold of a query tensor copied out of its (B, .., H, ..) layout: `permute(0, 2, 1, 3).reshape(-1, L, D)`.

scores.py's batch_major reads the fold of q @ kᵀ's first operand from the view it is of (`q.view(B * H, L, D)` of a
contiguous (B, H, L, D)). A query permuted first and then reshaped is a copy with no base (NeMo FastPitch's
MultiHeadAttn: `head_q.permute(0, 2, 1, 3).reshape(-1, L, D)` of its (B, L, H, D) projection), or a view of a base
whose axes are in another order (a time-major (L, B, H, D) whose strides let the reshape merge B and H). The function that
made the product holds the tensor it was copied from, under a name of its own: its 4-D local with as many elements,
whose two axes beside (L, D) fold to the B * H rows, and that equals the query once permuted and reshaped so. Its
earlier axis of those two is the batch (a projection's (B, L, H, D), (B, H, L, D), a time-major (L, B, H, D)); the fold
is batch-major where that axis is outermost in the rows. Only the product's innermost program frame is read, once per
product of 3-D operands that batch_major did not read (no other frames, no other products). A heads-first local
(H, B, L, D) would be taken for (B, H, L, D): the convention read here is the batch first among the folded axes.
"""

from __future__ import annotations

import itertools
import sys

import torch

from maskcli.trace.held import program_frames

MOST = 1 << 20  # elements of a query compared at most


def copied_fold(a, out) -> tuple[int, int] | None:
    """(B, H) where `a` (B * H, L, D) is a copy of a 4-D tensor its caller holds, folded batch-major; None else."""
    if not isinstance(a, torch.Tensor) or a.dim() != 3 or out.dim() != 3 or a.numel() > MOST:
        return None
    frame = next(program_frames(sys._getframe(1), 1), None)
    if frame is None:
        return None
    rows, length, width = a.shape
    for value in list(frame.f_locals.values()):
        if not isinstance(value, torch.Tensor) or value is a or value.dim() != 4 or value.numel() != a.numel() \
                or value.dtype != a.dtype or value.device != a.device:
            continue
        shape = value.shape
        for order in itertools.permutations(range(4)):
            outer, inner, at_l, at_d = order
            if shape[at_l] != length or shape[at_d] != width or shape[outer] < 2 or shape[inner] < 2:
                continue
            if torch.equal(value.permute(order).reshape(a.shape), a):
                batch = min(outer, inner)  # (the tensor's earlier axis of the two is its batch)
                return (int(shape[outer]), int(shape[inner])) if outer == batch else None
    return None
