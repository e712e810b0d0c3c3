"""checks/handedcausal.py and trace/handedcells.py: a model call handed a mask that states a direction per query (a
prefix LM's) whose self-attention ran plain causal (handed-mask-made-causal), caught in the published bug's
reproduction (tests/data/bugs) and in a program written another way (tests/data/handed), quiet on the fixes; the
flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug, first, traced
from maskcli.trace.handedcells import handed_cells

HANDED = Path(__file__).parent / "data" / "handed"


def test_megatron_prefix_lm_built_as_causal_is_found(tmp_path):
    # bigscience-workshop/Megatron-DeepSpeed 5207386 (blind-bh): the UL2 prefix-LM decoder built with
    # pretrain_causal_attention=True; EmbeddingPipe drops the dataset's dec_mask (inputs[2]) and the softmax adds its
    # own triu. Row 0's prefix is its first 9 tokens (8 inputs, bos), row 1's its first 7 (6 inputs, bos)
    hit = check_bug(tmp_path, "megatron_deepspeed_ul2_prefix_lm_built_as_causal_pipe", "handed-mask-made-causal")[0]
    assert hit["source"] == "inputs[2] of the model call"
    prefix = [9, 7]
    assert tuple(hit["cell"]) == first((2, 16, 16), lambda b, q, k: q < k < prefix[b])


def test_a_collators_4d_prefix_mask_replaced_by_is_causal(tmp_path):
    """Written another way: a collator's (B, 1, L, L) bool mask handed as attention_mask over a right-padded batch, the
    model's SDPA called with is_causal=True where the mask is not 2-D; its fix hands the mask on."""
    status, found, report = traced(tmp_path, "prefix_lm_4d_mask_replaced_by_is_causal", False, HANDED)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "handed-mask-made-causal")
    assert hit["severity"] == "wrong" and hit["source"] == "attention_mask of the model call"
    prefix = [4, 3]
    assert tuple(hit["cell"]) == first((2, 8, 8), lambda b, q, k: q < k < prefix[b])
    status, found, report = traced(tmp_path, "prefix_lm_4d_mask_replaced_by_is_causal", True, HANDED)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_what_is_read_as_a_handed_mask():
    """A square (B, L, L) or (B, 1, L, L) mask of bools or 0/1 integers, by name or as an item of a tuple; not a float
    mask, a (B, H, L, L) one of several heads, a 2-D padding mask, or a non-square one."""
    tril = torch.ones(2, 1, 4, 4).tril()
    name, cells = handed_cells({"inputs": (torch.zeros(2, 4, dtype=torch.long), tril.long())})["handed_cells"]
    assert name == "inputs[1]" and cells.shape == (2, 4, 4) and (cells == np.tril(np.ones((4, 4), bool))).all()
    assert handed_cells({"mask": tril.bool()[:, 0]})["handed_cells"][0] == "mask"
    assert handed_cells({"mask": tril}) == {}  # (float: an additive mask's values are not cells)
    assert handed_cells({"mask": torch.ones(2, 4, 4, 4, dtype=torch.bool)}) == {}
    assert handed_cells({"mask": torch.ones(2, 4, dtype=torch.bool)}) == {}
    assert handed_cells({"mask": torch.ones(2, 3, 4, dtype=torch.bool)}) == {}
    assert handed_cells({"mask": tril.long() * 2}) == {}
