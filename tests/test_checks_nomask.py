"""checks/nomask.py: a call site over the same ids that is causal handed one of no attention_mask / an all-ones one,
and sees later keys handed the other; the reference is torch.tril."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

NOMASK = Path(__file__).parent / "data" / "nomask"


def first_later(t: int) -> list[int]:
    """(query, key) of the first cell a full mask has past the causal one (torch.tril's complement)."""
    return [int(x) for x in (~torch.tril(torch.ones(t, t, dtype=torch.bool))).nonzero()[0]]


def test_falcon_sdpa_alibi_without_a_mask_drops_causal(tmp_path):
    """transformers#30123 (written blind, batch blind-ar): no attention_mask, so the bare ALiBi bias became attn_mask;
    the same ids with an all-ones mask are causal. The no-mask call is said, once per layer site."""
    hits = check_bug(tmp_path, "falcon_sdpa_alibi_no_mask_drops_causal", "mask-none-differs")
    assert all(hit["message"].startswith("handed no attention_mask") for hit in hits), hits
    assert hits[0]["cell"] == [0, *first_later(7)], hits


def test_a_padding_branch_that_forgets_the_triangle(tmp_path):
    """Written the other way round: a nanoGPT-style softmax whose mask branch builds the padding alone; the all-ones
    call is said; its fix (padding and the triangle) is quiet."""
    name = "gpt_padding_branch_drops_causal_softmax"
    status, found, report = traced(tmp_path, name, False, NOMASK)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "mask-none-differs"]
    assert hits and all(h["severity"] == "wrong" and "an attention_mask of all ones" in h["message"] for h in hits), report
    assert hits[0]["cell"] == [0, *first_later(6)], report
    status, found, report = traced(tmp_path, name, True, NOMASK)
    assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report
