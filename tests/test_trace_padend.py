"""trace/padend.py: the float samples beside a held padding mask, read where they are exactly 0 on every channel,
against a loop over the samples."""

from __future__ import annotations

import torch

from maskcli.trace.padend import _zeros


def _by_loop(x: torch.Tensor, samples_axis: int) -> list[list[bool]]:
    """Each row's samples, True where every channel is 0, by a loop (x (B, S), (B, C, S) or (B, S, C))."""
    rows = []
    for b in range(x.shape[0]):
        row = []
        for s in range(x.shape[samples_axis]):
            values = x[b, s] if x.dim() == 2 else x[b, :, s] if samples_axis == 2 else x[b, s, :]
            row.append(bool((values == 0).all()))
        rows.append(row)
    return rows


def test_the_zeros_of_each_layout_against_a_loop():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 7)
    x[0, :, 5:] = 0.0
    x[1, 0, 2] = 0.0  # (one channel alone at 0: not a zero sample)
    assert _zeros(x, (3, 7)).tolist() == _by_loop(x, 2)
    assert _zeros(x.transpose(1, 2).contiguous(), (3, 7)).tolist() == _by_loop(x.transpose(1, 2), 1)
    assert _zeros(x[:, 0], (3, 7)).tolist() == _by_loop(x[:, 0], 1)


def test_other_values_are_not_read():
    assert _zeros(torch.zeros(3, 7, dtype=torch.long), (3, 7)) is None  # (integers: ids, not samples)
    assert _zeros(torch.zeros(2, 7), (3, 7)) is None  # (another batch)
    assert _zeros(torch.zeros(3, 5, 6), (3, 7)) is None  # (no axis of the mask's samples)
    assert _zeros([0.0] * 7, (3, 7)) is None


def test_a_float_mask_over_the_samples_is_no_input():
    """A float mask or bias held beside the padding mask (DeepSpeed's Bloom float attn_mask, 0 = keep): its zeros are
    kept samples, not a padding value, so it is not read as the input (it drew padding-mask-wrong-end on a correct
    program)."""
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :3] = False
    for fill in (float("-inf"), torch.finfo(torch.float32).min, -10000.0, 1.0):
        assert _zeros(torch.where(keep, 0.0, fill), (2, 6)) is None
        assert _zeros(torch.where(keep, fill, 0.0)[:, None, :].expand(2, 4, 6).contiguous(), (2, 6)) is None
    assert _zeros(torch.zeros(2, 6), (2, 6)) is None  # (all zeros: no values to tell samples from a mask)
