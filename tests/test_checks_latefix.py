"""checks/latefix.py: a padding mask's fix-up of rows with no key applied in place after the attention, caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/latefix), quiet on the
fixes, on a fix-up before the call, on a mask refilled for another batch and on one that masks more after the call;
the flagged cell against a plain loop over the program's own padding."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

import maskcli
from checkbugs import check_bug, first
from maskcli.checks.registry import severity

LATEFIX = Path(__file__).parent / "data" / "latefix"


def test_transacts_adjust_mask_after_the_encoder_is_found(tmp_path):
    # reczoo/FuxiCTR 3a060ba: the raw key_padding_mask to nn.TransformerEncoder, adjust_mask only before max pooling
    found = check_bug(tmp_path, "fuxictr_transact_empty_history_key_padding_mask_fully_masked", "mask-fixed-after-call")
    history = [[0, 0, 4, 9, 2, 7], [0] * 6, [3, 8, 1, 5, 6, 11]]  # the program's click_history, 0 = padding
    # adjust_mask unmasks the last slot of each row that is padding throughout
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: not any(history[b]) and k == 5)
    assert "`mask`" in found[0]["message"] and "key 5 of row 1" in found[0]["message"]


def test_a_keep_mask_given_its_first_slot_after_sdpa_is_found(tmp_path):
    # written otherwise: SDPA with a bool keep-mask over right-padded histories, the first slot kept before pooling
    found = check_bug(tmp_path, "bst_empty_history_keep_mask_fixed_before_pooling", "mask-fixed-after-call", folder=LATEFIX)
    keep = [[1, 1, 1, 0, 0], [0] * 5, [1] * 5]  # the program's attention_mask, True = a real behavior
    assert tuple(found[0]["cell"]) == first((3, 5, 5), lambda b, q, k: not any(keep[b]) and k == 0)
    assert [f["code"] for f in found] == ["mask-fixed-after-call"]


class Encoder(nn.Module):
    """An encoder layer over a key padding mask (True = padding), then `after(mask)` on the same tensor."""

    def __init__(self, after=None, before=None):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.after, self.before = after, before

    def forward(self, x, padding_mask):
        if self.before:
            self.before(padding_mask)
        out = self.layer(x, src_key_padding_mask=padding_mask)
        if self.after:
            self.after(padding_mask)
        return out


def _unmask_last(mask):
    mask[mask.all(dim=-1), -1] = False


def _codes(**hooks) -> list:
    torch.manual_seed(0)
    padding = torch.tensor([[True, True, False, False], [True, True, True, True], [False, False, False, False]])
    with maskcli.trace() as t, torch.no_grad():
        Encoder(**hooks).train()(torch.randn(3, 4, 8), padding)
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_a_fix_up_before_the_call_a_refilled_buffer_and_more_masking_after_it_are_quiet():
    assert ("mask-fixed-after-call", "wrong") in _codes(after=_unmask_last)  # (the three below are quiet for a reason)
    assert not [c for c in _codes(before=_unmask_last) if c[0] == "mask-fixed-after-call"]  # the fix in its place

    def refill(mask):  # the next batch's padding written into the same buffer: other rows change too
        mask.copy_(torch.tensor([[False, False, False, True], [True, False, False, False], [True, True, False, False]]))

    assert not [c for c in _codes(after=refill) if c[0] == "mask-fixed-after-call"]

    def mask_more(mask):  # more padding after the call: nothing the call missed
        mask[0, 2] = True

    assert not [c for c in _codes(after=mask_more) if c[0] == "mask-fixed-after-call"]
