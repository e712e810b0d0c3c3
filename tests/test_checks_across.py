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
    query is placed among the keys, so no sees-later; with either word renamed away, still quiet (the `media` argument
    handed to the function attending, trace/held.py kv_given, says it too)."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    name = "flamingo_masked_cross_attention_media_locations"
    source = (folder / f"{name}.py").read_text()
    for old, new in ((None, None), ("gated_xattn", "gated_layer"), ("MaskedCrossAttention", "MaskedMediaAttention")):
        (tmp_path / f"{name}.py").write_text(source if old is None else source.replace(old, new))
        status, found, report = traced(tmp_path, name, False, tmp_path)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    (tmp_path / f"{name}.py").write_text(source.replace("gated_xattn", "gated_layer")
                                         .replace("MaskedCrossAttention", "MaskedOtherAttention").replace("media", "stuff"))
    status, found, report = traced(tmp_path, name, False, tmp_path)  # nothing said: the keys outnumber the queries
    assert "sees-later" in [f["code"] for f in found], report  # (as any self-attention's; what the three words end)


QUIET = Path(__file__).parent / "data" / "quiet"

WAITK = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn

class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.is_cross_attention = True
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)
    def forward(self, hidden, encoder_out, mask):
        b, t, _ = hidden.shape
        q = self.q(hidden).view(b, t, 2, 4).transpose(1, 2)
        k, v = self.kv(encoder_out).view(b, encoder_out.shape[1], 2, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 8)

class SimulMT(nn.Module):
    def __init__(self):
        super().__init__()
        self.cross = CrossAttention()
    def forward(self, tgt, encoder_out, wait_k):
        t, s = tgt.shape[1], encoder_out.shape[1]
        read = 1 if "--fixed" not in sys.argv else wait_k  # the bug: a wait-1 triangle under a stated wait-3
        return self.cross(tgt, encoder_out, torch.ones(t, s, dtype=torch.bool).tril(read - 1))

torch.manual_seed(0)
with torch.no_grad():
    SimulMT()(torch.randn(2, 5, 8), torch.randn(2, 5, 8), wait_k=3)
'''


def test_a_wait_k_policy_the_program_states_explains_the_triangle(tmp_path):
    """Wait-k simultaneous translation (fairseq's `waitk` in an argparse Namespace): with k = 1 the cross-attention's
    triangle is the stated policy, quiet; a wait-1 triangle under `wait_k=3` handed to the model call still contradicts
    it (its message names the policy), and the policy's own mask (query i reads keys 0..i + 2) is quiet."""
    import torch

    status, found, report = traced(tmp_path, "waitk_cross_attention_k1", False, QUIET)
    assert status == 0 and [f for f in found if f["code"] == "cross-attention-causal"] == [], report
    (tmp_path / "waitk_argument.py").write_text(WAITK)
    status, found, report = traced(tmp_path, "waitk_argument", False, tmp_path)
    hit = next(f for f in found if f["code"] == "cross-attention-causal")
    assert status == 1 and hit["severity"] == "wrong", report
    assert "wait_k=3 given to SimulMT" in hit["message"] and hit["expected"] == "query i reads keys 0..i + 2 (wait-3)"
    hidden = int((~torch.ones(5, 5, dtype=torch.bool).tril()).sum())
    assert f"({hidden} cells of later memory hidden)" in hit["message"]
    status, found, report = traced(tmp_path, "waitk_argument", True, tmp_path)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_memory_handed_to_the_function_attending_says_cross_attention():
    """trace/held.py's kv_given: a function that takes a memory argument (`context`, `encoder_hidden_states`) and holds
    a tensor there other than its queries' is a cross-attention (its shape kept: context.cross asks that the keys be
    its length, which a joint attention's are not); None, or the queries' own tensor, is self-attention
    (lucidrains' `context = default(context, x)`); a caller's memory does not speak for its module's own call."""
    import torch
    from torch import nn

    from maskcli.trace.held import kv_given

    class Attention(nn.Module):
        def forward(self, x, context=None):
            context = x if context is None else context
            return kv_given([self])

    class SelfAttention(nn.Module):
        def forward(self, x):
            return kv_given([self])

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SelfAttention()

        def forward(self, x, memory):
            return self.attn(x)

    x, other = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)
    attention = Attention()
    assert attention(x, context=other) == ("context of forward() of test_checks_across.py", (1, 3))
    assert attention(x) is None and attention(x, context=x) is None
    layer = Layer()
    assert layer(x, other) is None  # (Layer's `memory` is not the self-attention's: its module's forward decides)



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
