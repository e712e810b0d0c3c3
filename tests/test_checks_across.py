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


def test_cross_passed_by_the_layer_that_projects_the_keys():
    """trace/held.py's cross_passed: the innermost running module with weights handed a context tensor is a
    cross-attention (its parameter-free attend inside it is not asked); handed None, or its own input, it is not; a
    layer that takes `memory` but calls a self-attention with weights of its own does not make that one cross."""
    import torch
    from torch import nn

    from maskcli.trace.held import cross_passed

    seen = []

    class Attend(nn.Module):  # no weights: the kernel wrapper
        def forward(self, q, k):
            seen.append(cross_passed(stack))
            return q

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_k, self.attend = nn.Linear(2, 2), Attend()

        def forward(self, x, context=None, context_mask=None):
            return self.attend(x, self.to_k(context if context is not None else x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()

        def forward(self, x, memory=None):
            return self.self_attn(x)

    x = torch.zeros(1, 3, 2)
    attention, layer = Attention(), Layer()
    stack = [attention, attention.attend]
    attention(x, context=torch.zeros(1, 4, 2))
    attention(x)
    attention(x, context=x)
    attention(x, context=torch.zeros(1, 4, 2), context_mask=torch.ones(1, 4, dtype=torch.bool))
    stack = [layer, layer.self_attn, layer.self_attn.attend]
    layer(x, memory=torch.zeros(1, 4, 2))
    assert seen == [("Attention.forward(context=…)", "context_mask", (3, 4)), None, None,
                    ("Attention.forward(context=…)", None, (3, 4)), None]


def test_cross_attention_handed_its_context_reads_no_decoder_padding_on_its_keys(tmp_path):
    """x-transformers b0715f2's fix: a cross-attention block given `context` and no `context_mask` attends to all of an
    unpadded context; the decoder's `mask` (its queries' padding) says nothing of those keys: no finding."""
    status, found, report = traced(tmp_path, "x_transformers_cross_attention_uses_decoder_mask_for_context", True)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
