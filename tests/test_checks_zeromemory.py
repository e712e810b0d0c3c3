"""checks/zeromemory.py (and trace/zeromemory.py): a cross-attention against the memory positions the program zeroed
as padding in the model call's input."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, first, traced

ZERO = Path(__file__).parent / "data" / "zeromemory"


def test_diffusers_pixart_alpha_padded_t5_tokens_unmasked_in_cross_attention(tmp_path):
    """diffusers#5752: with two images per prompt, PixArt's mask_feature zeroed the padded T5 states (3 real tokens of
    8) and called the transformer without encoder_attention_mask. Batch rows 2-3 (the prompt's, after the CFG
    negative's rows 0-1, which are not zeroed) see keys 3-7: the first such cell by a double loop over an unmasked
    cross-attention of 4 image tokens."""
    hits = check_bug(tmp_path, "diffusers_pixart_alpha_padded_t5_tokens_unmasked_in_cross_attention", "zero-memory-seen")
    zeroed = torch.zeros(4, 8, dtype=torch.bool)
    zeroed[2:, 3:] = True  # the tokenizer's padding of the prompt's rows, multiplied into their states
    assert tuple(hits[0]["cell"]) == first((4, 4, 8), lambda b, q, k: bool(zeroed[b, k]))


def test_imagen_text_embeds_zeroed_cross_attention_unmasked(tmp_path):
    """Written another way: imagen-pytorch's masked_fill of the padded text embeddings, nn.MultiheadAttention's
    cross-attention over a padded batch of three captions (5, 2 and 3 tokens of 6), the key_padding_mask dropped. Row 0
    has one zero position alone (no run: not read as padding); row 1's keys 2-5 are the first cell. Its fix hands
    key_padding_mask=~text_mask over the same zeroed states: quiet."""
    status, found, report = traced(tmp_path, "imagen_text_embeds_zeroed_cross_attention_unmasked", False, ZERO)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "zero-memory-seen"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    tokens = torch.tensor([[7, 3, 9, 4, 2, 0], [5, 8, 0, 0, 0, 0], [6, 1, 2, 0, 0, 0]])
    runs = (tokens == 0) & ((tokens == 0).sum(1, keepdim=True) >= 2)
    assert tuple(hits[0]["cell"]) == first((3, 16, 6), lambda b, q, k: bool(runs[b, k]))
    status, found, report = traced(tmp_path, "imagen_text_embeds_zeroed_cross_attention_unmasked", True, ZERO)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
