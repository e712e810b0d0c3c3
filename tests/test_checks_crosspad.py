"""checks/crosspad.py: a cross-attention handed no context mask that hides the context keys at the queries' padding."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

HELD = Path(__file__).parent / "data" / "held"


def test_x_transformers_context_mask_defaults_to_decoder_mask(tmp_path):
    """x-transformers b0715f2: `input_mask = default(context_mask, mask)` hides context keys 4, 5 of row 1, which the
    decoder's right-padded `mask` pads; the fix (`context_mask if has_context else mask`) is quiet."""
    import torch

    hit = check_bug(tmp_path, "x_transformers_cross_attention_uses_decoder_mask_for_context", "context-masked-by-queries")[0]
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    padded = [(b, k) for b in range(2) for k in range(6) if not mask[b, k]]  # the reference: a plain loop
    assert f"batch row {padded[0][0]} hides context keys {[k for b, k in padded if b == padded[0][0]]}" in hit["message"]
    assert hit["source"] == "context_mask=None"


def test_encoder_attention_mask_falls_back_to_left_padded_attention_mask(tmp_path):
    """Written another way: HF names (encoder_hidden_states, encoder_attention_mask), left padding, an SDPA bool mask:
    the first padded row's hidden keys are where its attention_mask is 0; the fix (no mask for the encoder) is quiet."""
    import torch

    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    row = next(b for b in range(3) if (attention_mask[b] == 0).any())
    status, found, report = traced(tmp_path, "cross_context_mask_fallback", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "context-masked-by-queries")
    assert hit["severity"] == "wrong"
    assert f"batch row {row} hides context keys {(attention_mask[row] == 0).nonzero().flatten().tolist()}" in hit["message"]
    assert "encoder_attention_mask=None" in hit["message"]
    status, found, report = traced(tmp_path, "cross_context_mask_fallback", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_quiet_where_the_context_padding_is_its_own(tmp_path):
    """Cross-attentions of other published bugs, buggy and fixed (GPT-2's dropped encoder mask, SpeechBrain's dropped
    memory padding): their hidden keys are no queries' padding handed in place of a context mask: not this code."""
    for name in ("gpt2_cross_attention_drops_encoder_mask", "speechbrain_transformer_asr_decode_no_memory_padding_mask"):
        for fixed in (False, True):
            status, found, report = traced(tmp_path, name, fixed)
            assert [f for f in found if f["code"] == "context-masked-by-queries"] == [], report
