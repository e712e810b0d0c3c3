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


def test_laion_temporal_aggregation_attentional_pooler_attends_zero_padded_frames(tmp_path):
    """LAION-AI/temporal-embedding-aggregation#14: an AttentionalPooler's CrossAttention (einsum scores, a softmax
    handed no mask) over a CLS token prepended to per-frame embeddings zero padded to 16 frames (clips of 16, 9 and 4
    frames). The fix masks the padded frames by zero_masks; before it the learned queries saw them. The first cell by a
    double loop over the upstream layout (key 0 the CLS, key k frame k - 1): batch row 1, query 0, key 10. Its fix
    hides them (CLS row: every real frame; other rows: tril): quiet."""
    hits = check_bug(tmp_path, "laion_temporal_aggregation_attentional_pooler_attends_zero_padded_frames",
                     "zero-memory-seen")
    lengths = [16, 9, 4]
    assert tuple(hits[0]["cell"]) == first((3, 17, 17), lambda b, q, k: k >= 1 and k - 1 >= lengths[b])
    assert "padding whether it comes first or last" in hits[0]["message"]


def test_latent_pooler_left_padded_clips_registers_appended_sdpa_unmasked(tmp_path):
    """Written another way: a latent pooler over clips LEFT-padded with zero frames (5, 12 and 8 real of 12), two
    register tokens appended to the memory, SDPA handed no mask, the config a dict. Row 0's zero frames 0-6 are keys
    0-6 (the double loop's first cell: batch row 0, query 0, key 0); the rule judges only the keys that are padding
    whether the registers come first or last (keys 2-6), so its cell is in that row and query, on a padded frame. Its
    fix (a boolean key mask from the zero frames, the registers kept) is quiet."""
    name = "latent_pooler_left_padded_clips_registers_appended_sdpa_unmasked"
    status, found, report = traced(tmp_path, name, False, ZERO)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "zero-memory-seen" and f["severity"] == "wrong"]
    assert hits, report
    lengths, frames = [5, 12, 8], 12
    padded = lambda b, q, k: k < frames - lengths[b]  # noqa: E731 (keys 0-11 the frames, 12-13 the registers)
    b, q, k = hits[0]["cell"]
    assert (b, q) == first((3, 3, 14), padded)[:2] and padded(b, q, k) and k == 2
    assert "holds as exactly 0 in every channel" in hits[0]["message"]
    status, found, report = traced(tmp_path, name, True, ZERO)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_mha_pooler_cls_memory_masked_and_dropped_frame_quiet(tmp_path):
    """A CLS token prepended to zero-padded frames under an nn.MultiheadAttention pooler handed its key_padding_mask,
    and a clip whose dropped frame is zeros between real ones, attended unmasked: no finding."""
    status, found, report = traced(tmp_path, "mha_pooler_cls_memory_masked_and_dropped_frame_quiet", False, ZERO)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
