"""checks/headadded.py: a 0/1 head mask added to the scores before the softmax, which cancels it, caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/headadded), quiet on
the fixes (the mask multiplied in); the heads named against the head mask each program builds."""

from __future__ import annotations

import re
from pathlib import Path

from checkbugs import check_bug

HEADADDED = Path(__file__).parent / "data" / "headadded"


def _marked(message: str) -> tuple[list[int], list[int]]:
    ones, zeros = re.search(r"1 on heads ([\d, ]+), 0 on heads ([\d, ]+), of", message).groups()
    return [int(h) for h in ones.split(", ")], [int(h) for h in zeros.split(", ")]


def test_tome_vit_head_mask_added_to_the_scores_is_found(tmp_path):
    """PrunaAI/pruna#537 (573dc33, written blind): ToMeViTSelfAttention adds HF's (1, H, 1, 1) head_mask to the
    scores; the program prunes head 1 of 4 in every layer."""
    found = check_bug(tmp_path, "pruna_token_merging_tome_vit_head_mask_added_to_scores", "head-mask-added")
    head_mask = [1.0, 0.0, 1.0, 1.0]
    expected = ([h for h, m in enumerate(head_mask) if m == 1], [h for h, m in enumerate(head_mask) if m == 0])
    assert all(_marked(f["message"]) == expected for f in found)


def test_a_per_layer_head_mask_added_beside_a_padding_bias_is_found(tmp_path):
    """The same bug written another way: a right-padded text encoder, einsum scores plus a -10000 padding bias, and a
    (num_layers, heads) head mask viewed as (heads, 1, 1) and added; layer 0 prunes head 2, layer 1 head 0."""
    found = check_bug(tmp_path, "padded_text_encoder_head_mask_added_with_padding_bias", "head-mask-added",
                      folder=HEADADDED)
    pruned = {0: 2, 1: 0}
    expected = {tuple(_marked_for(layer, heads=4)) for layer in pruned.values()}
    assert {tuple(map(tuple, _marked(f["message"]))) for f in found} == expected


def _marked_for(pruned: int, heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(h for h in range(heads) if h != pruned), (pruned,)
