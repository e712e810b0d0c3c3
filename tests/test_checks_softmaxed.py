"""checks/softmaxed.py (with maskcli/trace/after.py, which follows a softmax's weights): a mask written into the
weights after the softmax (-inf, or a fill at most -1e4), on a reproduction of a published bug and on programs written
otherwise, and quiet where the mask is filled into the scores before the softmax or rows are zeroed after it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity


def test_nisqa_alignment_mask_after_softmax_is_flagged_and_its_fix_is_not(tmp_path):
    # gabrielmittag/NISQA#17: -inf written into softmaxed weights over padded reference windows
    check_bug(tmp_path, "nisqa_alignment_masks_after_softmax", "masked-after-softmax")


def traced(program) -> list:
    with maskcli.trace() as t, torch.no_grad():
        program()
    return [(f.code, severity(f), f.message) for group in t.groups() for f in group.findings]


def _heads(lengths, length=5, heads=2, left=True):
    torch.manual_seed(0)
    q = torch.randn(len(lengths), heads, length, 4)
    k = torch.randn(len(lengths), heads, length, 4)
    v = torch.randn(len(lengths), heads, length, 4)
    keep = torch.zeros(len(lengths), length, dtype=torch.bool)
    for b, n in enumerate(lengths):  # (a loop over rows: the reference padding, left or right)
        if left:
            keep[b, length - n:] = True
        else:
            keep[b, :n] = True
    return q, k, v, keep


def test_a_multi_head_left_padded_fill_after_softmax_is_wrong():
    """Written otherwise: 4-D heads, left padding, out-of-place masked_fill with a finite -1e9 after the softmax."""
    q, k, v, keep = _heads([5, 3])

    def program():
        weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        weights = weights.masked_fill(~keep[:, None, None, :], -1e9)
        return weights @ v

    found = [f for f in traced(program) if f[0] == "masked-after-softmax"]
    assert len(found) == 1 and found[0][1] == "wrong", found
    # the cells filled, by a plain loop: 2 heads x 5 queries x the 2 padded keys of batch row 1
    cells = sum(1 for b in range(2) for h in range(2) for i in range(5) for j in range(5) if not keep[b, j])
    assert f"-1e+09 into {cells} cells" in found[0][2] and "batch rows [1]" in found[0][2], found


def test_an_in_place_fill_of_minus_inf_after_softmax_is_wrong():
    q, k, v, keep = _heads([2, 4], left=False)

    def program():
        weights = F.softmax(torch.matmul(q, k.transpose(2, 3)), dim=-1)
        weights.masked_fill_(~keep[:, None, None, :], float("-inf"))
        return torch.matmul(weights, v)

    found = [f for f in traced(program) if f[0] == "masked-after-softmax"]
    assert len(found) == 1 and found[0][1] == "wrong" and "batch rows [0, 1]" in found[0][2], found


def test_the_mask_filled_before_the_softmax_is_quiet_and_matches_sdpa():
    q, k, v, keep = _heads([5, 3])
    out = {}

    def program():
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores[~keep[:, None, None, :].expand_as(scores)] = float("-inf")
        out["eager"] = torch.softmax(scores, dim=-1) @ v

    found = traced(program)
    assert [f for f in found if f[0] == "masked-after-softmax" or f[1] == "wrong"] == [], found
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    assert torch.allclose(out["eager"], reference, atol=1e-6)


def test_rows_zeroed_after_the_softmax_are_quiet():
    """WeNet / ESPnet: scores filled before, then rows with no key zeroed after (a fill of 0, not a mask)."""
    q, k, v, keep = _heads([5, 3])
    keep[1] = False  # a row with no key at all

    def program():
        pad = ~keep[:, None, None, :]
        scores = (q @ k.transpose(-1, -2)).masked_fill(pad, float("-inf"))
        weights = torch.softmax(scores, dim=-1).masked_fill(pad, 0.0)
        return weights @ v

    assert [f for f in traced(program) if f[0] == "masked-after-softmax"] == []


def test_timm_eva_mask_applied_after_softmax(tmp_path):
    """huggingface/pytorch-image-models#2236 (written blind, caught before any rule was changed for it): EvaAttention
    fills the padding with -inf after the softmax; the fix fills the scores before it and is quiet."""
    found = check_bug(tmp_path, "timm_eva_attention_mask_applied_after_softmax", "masked-after-softmax")
    assert "after the softmax" in found[0]["message"]
