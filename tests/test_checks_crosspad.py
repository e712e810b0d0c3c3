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


def test_pengshuang_context_mask_from_target_padding(tmp_path):
    """pengshuang/Transformer#7: `padding_mask(tgt_seq, src_seq)` for the context attention hides the memory keys where
    the target is padded (batch folded with its 2 heads by repeat_interleave); the fix `padding_mask(src_seq, tgt_seq)`
    is quiet."""
    import torch

    hit = check_bug(tmp_path, "pengshuang_context_attn_mask_from_target_padding", "context-masked-by-queries")[0]
    src = torch.tensor([[3, 5, 7, 9, 11, 0], [4, 6, 8, 10, 12, 14]])
    tgt = torch.tensor([[1, 2, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0]])
    b = next(b for b in range(2) if any(tgt[b, k] == 0 and src[b, k] != 0 for k in range(6)))  # the reference: loops
    hidden = [k for k in range(6) if tgt[b, k] == 0]
    first = next(k for k in hidden if src[b, k] != 0)
    assert f"batch row {b * 2} (of 2 samples folded with 2 rows each)" in hit["message"]
    assert f"hides memory keys {hidden} from every query" in hit["message"]
    assert f"calls key {first} real" in hit["message"]
    assert hit["source"] == "`src_seq` of Transformer at its pad id 0 (src_pad_idx)"


def test_nn_transformer_memory_mask_from_target_padding(tmp_path):
    """Written another way: a Seq2Seq around nn.Transformer handed memory_key_padding_mask=trg_pad_mask (pad id 1 on
    each side, every padded source key a padded target one too, so no padded key is seen): the real memory keys hidden
    are found; the fix (src_pad_mask) is quiet."""
    import torch

    src = torch.tensor([[5, 6, 7, 8, 9, 10, 1], [11, 12, 13, 14, 15, 1, 1], [4, 5, 6, 7, 8, 9, 10]])
    trg = torch.tensor([[2, 15, 16, 1, 1, 1, 1], [2, 17, 18, 19, 20, 1, 1], [2, 21, 22, 23, 3, 1, 1]])
    status, found, report = traced(tmp_path, "seq2seq_memory_mask_from_trg_padding", False, HELD)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "context-masked-by-queries" and f["severity"] == "wrong"]
    assert hits, report
    b = next(b for b in range(3) if any(trg[b, k] == 1 and src[b, k] != 1 for k in range(7)))
    assert f"batch row {b}: " in hits[0]["message"]
    assert f"hides memory keys {[k for k in range(7) if trg[b, k] == 1]} from every query" in hits[0]["message"]
    assert [f for f in found if f["code"] == "encoder-padding-ignored"] == [], report  # (no padded key is seen)
    status, found, report = traced(tmp_path, "seq2seq_memory_mask_from_trg_padding", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
