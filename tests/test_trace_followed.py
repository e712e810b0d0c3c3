"""trace/followed.py: the operands of a product, which of them hold a batch of their own, and a table of tensors
followed by identity that lets each go when it dies."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from checkbugs import traced
from maskcli.trace.followed import KEEP, batched, follow, operands_of

FEATURES = Path(__file__).parent / "data" / "features"


def test_the_operands_of_a_product_einsum_or_not():
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    assert operands_of(torch.matmul, (a, b)) == (a, b)
    assert operands_of(torch.einsum, ("ij,jk->ik", a, b)) == (a, b)
    assert operands_of(torch.einsum, ("ij,jk->ik", [a, b])) == [a, b]


def test_a_followed_tensor_is_let_go_when_it_dies_and_the_table_stays_bounded():
    found: dict = {}
    out = torch.ones(2, 2)
    follow(found, id(out), out, "call", "seen")
    ref, *entry = found[id(out)]
    assert ref() is out and entry == ["call", "seen"]
    del out, ref
    gc.collect()
    assert found == {}
    kept = [torch.ones(1) for _ in range(KEEP + 1)]
    for t in kept:
        follow(found, id(t), t)
    assert len(found) == 1  # (KEEP entries reached: all forgotten, the newest kept)


def test_a_table_broadcast_over_every_row_and_head_is_not_batched():
    table = torch.randn(16, 8)
    assert not batched(table[None, None].expand(2, 4, 16, 8))  # (Performer's random features)
    assert not batched(table[None].expand(3, 16, 8))
    assert batched(torch.randn(2, 4, 16, 8))  # (keys of a batch)
    assert batched(torch.randn(2, 1, 16, 8).expand(2, 4, 16, 8))  # (grouped-query keys over their heads)
    assert batched(table[None, None].expand(1, 4, 16, 8))  # (a batch of one says nothing)
    assert batched(table[None, None].expand(2, 4, 16, 8).contiguous())  # (a copy per row is the program's own)
    assert batched(table)  # (2-D: a projection's weight, not read as a batch at all)


def test_performer_random_features_are_no_scores_of_queries_by_keys(tmp_path):
    # a causal FAVOR+ decoder over a batch of two: q @ featuresᵀ was read as scores and its exp as a softmax over 16
    # "keys", and the module's causal=True then told causal-flag-ignored (lucidrains/performer-pytorch's, blind-rw)
    status, found, report = traced(tmp_path, "performer_causal_favor_features_batch_of_two", False, FEATURES)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
    assert "0 attention calls" in report, report


def test_performer_pytorch_encoder_decoder_keys_zeroed_are_still_weighed(tmp_path):
    """lucidrains/performer-pytorch 53d4b8f (written blind, blind-rw): generate dropped the context mask its caller
    passed, so the decoder's cross-attention attended the source's padding. At that commit a mask zeroes the padded
    keys before the feature map, which still weighs them (exp(0 - max) > 0; ce93107 later masked the values): the
    encoder's own attention sees its padding in both runs, padding-ignored, true of the bug and of its fix. Its
    random features are read as no scores: no causal-flag-ignored on the causal decoder."""
    blind = Path(__file__).parent / "data" / "blind"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "performer_pytorch_generate_drops_enc_context_mask", fixed, blind)
        codes = {f["code"] for f in found if f["severity"] == "wrong"}
        assert status == 1 and codes == {"padding-ignored"}, report
