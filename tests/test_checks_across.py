"""checks/across.py: a call a module states is cross-attention, masked as a causal triangle over the memory."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

HELD = Path(__file__).parent / "data" / "held"


def test_transformer_engine_inter_attention_causal(tmp_path):
    """TransformerEngine#565: the inter-attention (attention_type="cross") called with the self-attention's "causal"."""
    check_bug(tmp_path, "transformer_engine_decoder_cross_attention_causal_mask_type", "cross-attention-causal")


def test_is_cross_attention_with_is_causal(tmp_path):
    """Written another way: BERT's `is_cross_attention=True`, SDPA's is_causal handed on; the cells hidden are those
    torch.tril hides."""
    import torch

    status, found, report = traced(tmp_path, "cross_attention_is_causal", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "cross-attention-causal")
    hidden = int((~torch.ones(5, 5, dtype=torch.bool).tril()).sum())
    assert f"({hidden} cells of later memory hidden)" in hit["message"]
    assert "is_cross_attention=True" in hit["source"]
    status, found, report = traced(tmp_path, "cross_attention_is_causal", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_cross_said_by_the_innermost_modules():
    """trace/held.py's cross_said: an attention_type naming cross (a str or an Enum), is_cross_attention=True; a module
    saying is_cross_attention=False inside is self-attention whatever encloses it."""
    import enum

    from torch import nn

    from maskcli.trace.held import cross_said

    class AttnType(enum.Enum):
        self_attn = 1
        cross_attn = 2

    outer, inner = nn.Module(), nn.Module()
    outer.attention_type = AttnType.cross_attn
    assert cross_said([outer, inner]) == "Module.attention_type='cross_attn'"
    inner.is_cross_attention = False
    assert cross_said([outer, inner]) is None
    outer.attention_type, inner.is_cross_attention = "self", True
    assert cross_said([outer, inner]) == "Module.is_cross_attention=True"
    assert cross_said([nn.Module()]) is None
