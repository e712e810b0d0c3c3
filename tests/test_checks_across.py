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


def test_cross_class_is_the_innermost_modules_class_and_says_cross_only_with_other_keys():
    """The attending module's class named a cross-attention (OpenFlamingo's MaskedCrossAttention, an `XAttn`); a class
    that only ends in `attn` (FlexAttn, SelfAttention), an outer block so named, or one that states
    is_cross_attention=False is not. It is not the module's statement (cross_said: cross-attention-causal reads that),
    and context.cross believes it only where the keys are not as many as the queries (LDM's CrossAttention runs attn1's
    self-attention too)."""
    from types import SimpleNamespace

    from torch import nn

    from maskcli.checks.context import cross
    from maskcli.trace.held import cross_class, cross_said

    def named(name):
        return type(name, (nn.Module,), {})()

    assert cross_class([named("MaskedCrossAttention")]) == "MaskedCrossAttention"
    assert cross_said([named("MaskedCrossAttention")]) is None
    assert cross_class([named("Gated_XAttn")]) == "Gated_XAttn"
    for name in ("FlexAttn", "SelfAttention", "MaxAttention", "CrossAttentionBlockLayer"):
        assert cross_class([named(name)]) is None, name
    assert cross_class([named("CrossAttnDecoder"), named("SelfAttention")]) is None  # (only the innermost's class)
    said_self = named("LayerCrossAttention")
    said_self.is_cross_attention = False
    assert cross_class([said_self]) is None
    details = {"cross_class": "CrossAttention"}
    assert cross(SimpleNamespace(api="softmax", where="attn2", shape=(1, 2, 9, 24), details=details))
    assert not cross(SimpleNamespace(api="softmax", where="attn1", shape=(1, 2, 9, 9), details=details))


def test_flamingo_text_over_media_latents_is_cross_attention_and_quiet(tmp_path):
    """OpenFlamingo's MaskedCrossAttention: 9 text queries over 24 media latents, each text token seeing only its
    latest image's latents. Fewer queries than keys, yet a cross-attention (its class; `gated_xattn` its path): no
    query is placed among the keys, so no sees-later; with either word renamed away, still quiet."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    name = "flamingo_masked_cross_attention_media_locations"
    source = (folder / f"{name}.py").read_text()
    for old, new in ((None, None), ("gated_xattn", "gated_layer"), ("MaskedCrossAttention", "MaskedMediaAttention")):
        (tmp_path / f"{name}.py").write_text(source if old is None else source.replace(old, new))
        status, found, report = traced(tmp_path, name, False, tmp_path)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    (tmp_path / f"{name}.py").write_text(source.replace("gated_xattn", "gated_layer").replace("MaskedCrossAttention", "MaskedMediaAttention"))
    status, found, report = traced(tmp_path, name, False, tmp_path)  # neither said: the keys outnumber the queries
    assert "sees-later" in [f["code"] for f in found], report  # (as any self-attention's; what the two words end)
