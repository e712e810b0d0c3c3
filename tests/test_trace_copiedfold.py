"""trace/copiedfold.py: the fold of a query copied out of the 4-D tensor its function holds, against the layouts
torch's own permute / reshape make (row n of a batch-major fold is sample n // H, of a head-major one n % B)."""

from __future__ import annotations

import torch

from maskcli.trace.copiedfold import copied_fold


def _fold(order, shape=(3, 5, 2, 4)):
    projected = torch.randn(*shape)  # (held here, as the program's function holds its (B, L, H, D) projection)
    q = projected.permute(order).reshape(-1, shape[order[2]], shape[order[3]])
    return copied_fold(q, torch.empty(q.shape[0], q.shape[1], q.shape[1]))


def test_a_batch_major_copy_is_read_with_its_batch_and_heads():
    assert _fold((0, 2, 1, 3)) == (3, 2)  # FastPitch's (B, L, H, D) -> (B * H, L, D)
    assert _fold((1, 2, 0, 3), shape=(5, 3, 2, 4)) == (3, 2)  # time-major (L, B, H, D), the batch its earlier axis


def test_a_head_major_copy_and_an_unrelated_query_are_not_read():
    assert _fold((2, 0, 1, 3)) is None  # head-major: not said (both readings stay open)
    projected = torch.randn(3, 2, 5, 4)
    assert copied_fold(projected.view(6, 5, 4), torch.empty(6, 5, 5)) == (3, 2)  # (B, H, L, D) viewed: batch-major too
    other = torch.randn(6, 5, 4)
    assert copied_fold(other.clone(), torch.empty(6, 5, 5)) is None  # equal to no held tensor's layout
    # (the row-major layout each order makes, by a loop: row n of the batch-major copy is sample n // 2, head n % 2)
    held = torch.randn(3, 5, 2, 4)
    q = held.permute(0, 2, 1, 3).reshape(6, 5, 4)
    assert all(torch.equal(q[n], held[n // 2, :, n % 2]) for n in range(6))
