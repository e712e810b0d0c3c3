"""trace/crossing.py and checks/context.crossing: one reading of whether an attention call is a cross-attention, and
what in the program says so, read once per call site; programs written several ways."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import maskcli
from maskcli.checks.context import crossing
from maskcli.trace.crossing import Readings, read


def test_said_by_the_innermost_modules():
    """An attention_type naming cross (a str or an Enum), is_cross_attention=True; a module saying
    is_cross_attention=False inside is self-attention whatever encloses it (as the module says: by "said")."""
    import enum

    class AttnType(enum.Enum):
        self_attn = 1
        cross_attn = 2

    outer, inner = nn.Module(), nn.Module()
    outer.attention_type = AttnType.cross_attn
    here = sys._getframe()
    assert read([outer, inner], 3, 3, here) == {"cross": True, "by": "said", "source": "Module.attention_type='cross_attn'"}
    inner.is_cross_attention = False
    assert read([outer, inner], 3, 3, here) == {"cross": False, "by": "said", "source": "Module.is_cross_attention=False"}
    outer.attention_type, inner.is_cross_attention = "self", True
    assert read([outer, inner], 3, 3, here)["source"] == "Module.is_cross_attention=True"
    assert read([nn.Module()], 3, 3, here) is None


def test_torch_leaf_modules_do_not_push_the_saying_module_out_of_reach():
    """TransformerEngine's softmax calls an `nn.Softmax(dim=-1)` module under FusedScaleMaskSoftmax, under
    UnfusedDotProductAttention, under DotProductAttention, under the MultiheadAttention whose `attention_type` says
    cross: torch's own leaf modules say nothing and are not counted among the innermost modules read."""
    class Own(nn.Module):  # (a program's module)
        pass

    layer = Own()
    layer.attention_type = "cross"
    stack = [Own(), layer, Own(), Own(), Own(), nn.Softmax(dim=-1)]
    assert read(stack, 6, 7, sys._getframe())["source"] == "Own.attention_type='cross'"
    assert read([Own(), layer, Own(), Own(), Own(), Own()], 6, 7, sys._getframe()) is None


def test_said_by_the_layer_an_engine_hands_its_backend():
    """No module runs (an engine's backend, SGLang's `forward_decode(q, k, v, layer, forward_batch)`): a parameter of
    a function within the call holding an object that states itself says it, vLLM's `attn_type="encoder_decoder"`
    too; a type naming neither (vLLM's "decoder"), the function's `self`, a plain value say nothing."""

    class Layer:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    def backend(q, layer, scale=1.0):
        return read([], 1, 6, sys._getframe())

    assert backend(None, Layer(is_cross_attention=True)) == {
        "cross": True, "by": "said", "source": "layer.is_cross_attention=True (Layer, handed to backend())"}
    assert backend(None, Layer(is_cross_attention=False))["cross"] is False
    assert backend(None, Layer(attn_type="encoder_decoder"))["source"].startswith("layer.attn_type='encoder_decoder'")
    assert backend(None, Layer(attn_type="decoder")) is None
    assert backend(None, Layer(attn_type="my_encoder_decoder_v2")) is None
    assert backend(None, "cross") is None


def test_the_class_names_a_cross_attention_and_its_context_none_says_self():
    """The innermost module's class (OpenFlamingo's MaskedCrossAttention, an `XAttn`) says cross, as many keys as
    queries or not; LDM's CrossAttention also runs its self-attention (attn1), which its `context=None` states: self.
    A class only ending in `attn`, or an outer block so named, says nothing."""
    def named(name, forward=None):
        return type(name, (nn.Module,), {} if forward is None else {"forward": forward})()

    here = sys._getframe()
    assert read([named("MaskedCrossAttention")], 4, 4, here) == {"cross": True, "by": "class",
                                                                 "source": "class MaskedCrossAttention"}
    assert read([named("Gated_XAttn")], 4, 9, here)["by"] == "class"
    for name in ("FlexAttn", "SelfAttention", "MaxAttention", "CrossAttentionBlockLayer"):
        assert read([named(name)], 4, 9, here) is None, name
    assert read([named("CrossAttnDecoder"), named("SelfAttention")], 4, 9, here) is None  # (only the innermost's class)

    def forward(self, x, context=None):
        context = x if context is None else context  # (LDM: `context = default(context, x)`)
        return read([self], x.shape[1], context.shape[1], sys._getframe())

    ldm = named("CrossAttention", forward)
    x = torch.zeros(1, 9, 4)
    assert ldm(x) == {"cross": False, "by": "memory", "source": "context handed to CrossAttention.forward() of "
                      "test_trace_crossing.py is its queries' own tensor"}
    assert ldm(x, torch.zeros(1, 9, 4))["cross"] is True  # (attn2 over a memory as long as the queries)


def test_a_memory_handed_to_the_function_attending():
    """A function that takes a memory argument (`context`, `encoder_hidden_states`) and holds a tensor there other than
    its queries', whose length the keys have, is a cross-attention; None, or the queries' own tensor, is self-attention;
    a memory the keys are not as long as (a joint attention over both) says nothing; a caller's memory does not speak
    for its module's own call."""

    class Attention(nn.Module):
        def forward(self, x, context=None, k_len=None):
            context = x if context is None else context
            return Readings().of([self], (1, 1, x.shape[1], k_len or context.shape[1]))

    class SelfAttention(nn.Module):
        def forward(self, x):
            return Readings().of([self], (1, 1, x.shape[1], x.shape[1]))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SelfAttention()

        def forward(self, x, memory):
            return self.attn(x)

    x, other = torch.zeros(1, 3, 4), torch.zeros(1, 5, 4)
    attention = Attention()
    assert attention(x, context=other) == {"cross": True, "by": "memory",
                                           "source": "context handed to Attention.forward() of test_trace_crossing.py"}
    assert attention(x)["cross"] is False and attention(x, context=x)["cross"] is False
    assert attention(x, context=other, k_len=8) is None  # (8 keys: [x, context] joined, neither's own)
    layer = Layer()
    assert layer(x, other) is None  # (Layer's `memory` is not the self-attention's: the running module's call decides)


def test_a_context_passed_to_the_layer_that_projects_the_keys():
    """The innermost running module with weights handed a context tensor is a cross-attention, with its context-mask
    parameter handed None named (checks/crosspad.py); handed None, or its own input, it is not; a layer that takes
    `memory` but calls a self-attention with weights of its own does not make that one cross."""
    seen = []

    class Attend(nn.Module):  # no weights: the kernel wrapper
        def forward(self, q, k):
            seen.append(Readings().of(stack, (1, 1, q.shape[1], k.shape[1])))
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
    source = "context handed to Attention.forward() of test_trace_crossing.py"
    assert [None if r is None else (r["cross"], r.get("unmasked")) for r in seen] == [
        (True, "context_mask"), (False, None), (False, None), (True, None), (False, None)]
    assert seen[0]["source"] == source


def _crossings(program) -> dict[str, set]:
    """{call site: {(cross, by)}} of the attention calls `program()` makes under maskcli.trace()."""
    with maskcli.trace() as t:
        program()
    found: dict = {}
    for call in t.calls:
        reading = crossing(call)
        found.setdefault(call.where, set()).add((reading.cross, reading.by))
    return found


def test_nn_transformer_decoder():
    """nn.TransformerDecoder (torch's own code, no program frame inside it): each layer's self_attn is MHA(x, x, x),
    self; its multihead_attn is handed the memory as keys, cross, by that input (a decoder longer than its memory) or
    by its path where they are as many. Written with nn.MultiheadAttention under a name of the program's own, the
    keys' input alone says it."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    decoder = nn.TransformerDecoder(layer, num_layers=2).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    with torch.no_grad():
        found = _crossings(lambda: decoder(torch.randn(2, 7, 8), torch.randn(2, 4, 8), tgt_mask=causal))
    assert found == {f"layers.{i}.{name}": {expected} for i in range(2) for name, expected in
                     (("self_attn", (False, "own-keys")), ("multihead_attn", (True, "keys-input")))}
    with torch.no_grad():
        found = _crossings(lambda: decoder(torch.randn(2, 4, 8), torch.randn(2, 4, 8)))
    assert found["layers.1.multihead_attn"] == {(True, "path")} and found["layers.1.self_attn"] == {(False, "own-keys")}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, src):
            return self.mix(x, src, src, need_weights=False)[0]

    block = Block().eval()
    with torch.no_grad():
        assert _crossings(lambda: block(torch.randn(2, 3, 8), torch.randn(2, 6, 8))) == {"mix": {(True, "keys-input")}}


def test_t5_from_a_transformers_config():
    """T5 built from a transformers T5Config (random weights), the decoder longer than the encoder: every call of
    EncDecAttention is cross (handed key_value_states, the encoder's output), every SelfAttention call is self; with
    the module paths no help (the words checked are the program's own arguments)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, decoder_start_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 32, (2, 4))
    with torch.no_grad():
        found = _crossings(lambda: model(input_ids=ids, decoder_input_ids=torch.randint(1, 32, (2, 9))))
    cross = {where for where in found if "EncDecAttention" in where}
    assert cross and all(found[where] == {(True, "memory")} for where in cross), found
    selves = set(found) - cross
    assert selves and all(all(not c for c, _ in found[where]) for where in selves), found
    with maskcli.trace() as t:
        with torch.no_grad():
            model(input_ids=ids, decoder_input_ids=torch.randint(1, 32, (2, 9)))
    call = next(c for c in t.calls if "EncDecAttention" in c.where)
    assert crossing(call).source == "key_value_states handed to T5Attention.forward() of modeling_t5.py"


HAND = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn

class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(8, 8)
    def forward(self, x, CONTEXT=None):
        source = x if CONTEXT is None else CONTEXT
        q = self.q(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        k, v = self.kv(source).view(x.shape[0], source.shape[1], 2, 2, 4).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Mixer(), Mixer()])
    def forward(self, x, other):
        return self.blocks[1](self.blocks[0](x), other)

torch.manual_seed(0)
with torch.no_grad():
    Model()(torch.randn(2, 3, 8), torch.randn(2, 10, 8))
'''


def test_a_hand_written_cross_attention_with_a_context_argument(tmp_path):
    """A layer of neutral names (`blocks.1`, class Mixer) handed `context`: 3 queries over 10 memory keys, no mask, a
    correct program: quiet, its second block read as a cross-attention by that argument, its first (handed None) as a
    self-attention. The same program with the argument named `other_input` says nothing of its keys (only torchtune's
    (x, y) is read by its names: test_a_forward_of_x_and_y_read_by_its_first_two_hidden_states)."""
    from checkbugs import traced

    program = textwrap.dedent(HAND)
    namespace: dict = {}
    with maskcli.trace() as t:
        exec(compile(program.replace("CONTEXT", "context"), "hand.py", "exec"), namespace)
    assert [(c.where, crossing(c)[:2]) for c in t.calls] == [("blocks.0", (False, "memory")), ("blocks.1", (True, "memory"))]
    (tmp_path / "hand.py").write_text(program.replace("CONTEXT", "context"))
    status, found, report = traced(tmp_path, "hand", False, tmp_path)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    with maskcli.trace() as t:
        exec(compile(program.replace("CONTEXT", "other_input"), "hand.py", "exec"), {})
    assert [crossing(c)[:2] for c in t.calls] == [(False, "none")] * 2  # (fewer queries than keys: nothing said)


def test_a_perceiver_latent_array_as_long_as_its_inputs():
    """Perceiver: a latent array cross-attends to the inputs, then self-attends. Latents as many as the inputs (16 and
    16): equal lengths say nothing, the `context` handed says cross; the latent self-attention, handed none, is self."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_kv = nn.Linear(8, 8), nn.Linear(8, 16)

        def forward(self, x, context=None):
            context = x if context is None else context
            q = self.to_q(x)[:, None]
            k, v = self.to_kv(context)[:, None].chunk(2, dim=-1)
            return F.scaled_dot_product_attention(q, k, v)[:, 0]

    class Perceiver(nn.Module):
        def __init__(self):
            super().__init__()
            self.latents = nn.Parameter(torch.randn(16, 8))
            self.read_in, self.think = Attention(), Attention()

        def forward(self, inputs):
            latents = self.latents.expand(inputs.shape[0], -1, -1)
            latents = self.read_in(latents, context=inputs)
            return self.think(latents)

    torch.manual_seed(0)
    model = Perceiver().eval()
    with torch.no_grad():
        found = _crossings(lambda: model(torch.randn(2, 16, 8)))
    assert found == {"read_in": {(True, "memory")}, "think": {(False, "memory")}}


def test_a_self_attention_whose_keys_outnumber_its_queries_by_a_cache():
    """Decode steps over a KV cache: 1 query over 6, 7, 8... keys. The keys grew by each step's queries: self, even in
    a module whose class names a cross-attention; nn.MultiheadAttention handed the cache joined with the queries as
    its keys (an incremental decoder's): self, by its key input ending with its query input."""

    class CachedCrossAttention(nn.Module):  # (a name that would say cross-attention)
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x, cache):
            q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)
            cache.append((k, v))
            keys, values = (torch.cat(parts, dim=2) for parts in zip(*cache))
            return F.scaled_dot_product_attention(q, keys, values)[:, 0]

    torch.manual_seed(0)
    attention = CachedCrossAttention().eval()

    def decode():
        cache = []
        attention(torch.randn(2, 5, 8), cache)
        for _ in range(4):
            attention(torch.randn(2, 1, 8), cache)

    with torch.no_grad():
        with maskcli.trace() as t:
            decode()
    assert [c.shape[2:] for c in t.calls] == [(5, 5), (1, 6), (1, 7), (1, 8), (1, 9)]
    assert {crossing(c)[:2] for c in t.calls} == {(False, "cache")}

    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()

    def incremental():
        past = torch.randn(2, 4, 8)
        for _ in range(3):
            x = torch.randn(2, 1, 8)
            past = torch.cat([past, x], dim=1)
            mha(x, past, past, need_weights=False)

    with torch.no_grad():
        with maskcli.trace() as t:
            incremental()
    assert {crossing(c)[:2] for c in t.calls} == {(False, "cache")}


def test_read_once_per_module():
    """A module's reading is made at its first call and shared by its later ones (the same dict), however many."""

    class Attention(nn.Module):
        def forward(self, x, context):
            return F.scaled_dot_product_attention(x[:, None], context[:, None], context[:, None])

    attention = Attention()
    with maskcli.trace() as t:
        for length in (3, 4, 5):
            attention(torch.randn(1, 2, 4), torch.randn(1, length, 4))
    readings = [c.details["cross"] for c in t.calls]
    assert all(r is readings[0] for r in readings) and readings[0]["cross"] is True


def test_one_module_attending_to_itself_and_to_a_memory_through_one_helper_is_two_sites():
    """A decoder block that owns its weights and calls one attention helper twice, over its own tokens and then over
    the memory it is handed (no submodule per attention): each line is a site of its own, read on its own."""

    def attend(q, kv, causal):
        return F.scaled_dot_product_attention(q[:, None], kv[:, None], kv[:, None], is_causal=causal)[:, 0]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, memory):
            x = attend(self.proj(x), self.proj(x), True)
            return attend(x, memory, False)

    block = Block()
    with torch.no_grad(), maskcli.trace() as t:
        for _ in range(2):
            block(torch.randn(2, 5, 8), torch.randn(2, 7, 8))
    assert [(c.shape[2:], crossing(c)[:2]) for c in t.calls] == [((5, 5), (False, "none")), ((5, 7), (True, "memory"))] * 2


def test_a_layer_handed_query_and_key_as_the_annotated_transformer_writes_it():
    """MultiHeadedAttention.forward(query, key, value, mask) (the Annotated Transformer; Keras ports write
    `MultiHeadAttention(query, value, key)`): its self-attention handed x three times, or x + pos computed twice (other
    tensors, the same values), is self; its source attention handed the memory, as long as the target (8 and 8), is
    cross, whatever its name."""

    class MultiHeadedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, query, key, value, mask=None):
            q, k, v = (linear(x)[:, None] for linear, x in zip(self.linears, (query, key, value)))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, 0]

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = MultiHeadedAttention(), MultiHeadedAttention()

        def forward(self, x, m, pos, causal):
            x = self.first(x + pos, x + pos, x, causal)
            return self.second(x, m, m)

    torch.manual_seed(0)
    layer = Layer().eval()
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    with torch.no_grad():
        found = _crossings(lambda: layer(torch.randn(2, 8, 8), torch.randn(2, 8, 8), torch.randn(8, 8), causal))
    assert found == {"first": {(False, "inputs")}, "second": {(True, "inputs")}}
    with maskcli.trace() as t, torch.no_grad():
        layer(torch.randn(2, 8, 8), torch.randn(2, 8, 8), torch.randn(8, 8), causal)
    assert crossing(t.calls[1]).source == "key handed to MultiHeadedAttention.forward() of test_trace_crossing.py is " \
        "another tensor than its query"


def test_a_layer_handed_capital_q_and_k_around_an_inline_softmax():
    """nlp-tutorial's MultiHeadAttention.forward(Q, K, V, attn_mask), whose scores go through an inline nn.Softmax():
    handed the decoder's own states as K, self; handed the encoder's output, as long as the target (5 and 5), cross."""

    class MultiHeadAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.W_Q, self.W_K = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, Q, K, V, attn_mask=None):
            scores = self.W_Q(Q) @ self.W_K(K).transpose(-1, -2)
            if attn_mask is not None:
                scores = scores.masked_fill(attn_mask, -1e9)
            return nn.Softmax(dim=-1)(scores[:, None])[:, 0] @ V

    class DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.dec_self_attn, self.dec_enc_attn = MultiHeadAttention(), MultiHeadAttention()

        def forward(self, x, enc, pad):
            return self.dec_enc_attn(self.dec_self_attn(x, x, x), enc, enc, pad)

    torch.manual_seed(0)
    layer = DecoderLayer()
    pad = torch.tensor([True, False, False, False, False]).expand(1, 5, 5)
    with maskcli.trace() as t, torch.no_grad():
        layer(torch.randn(1, 5, 8), torch.randn(1, 5, 8), pad)
    assert [(crossing(call).cross, crossing(call).by) for call in t.calls] == [(False, "inputs"), (True, "inputs")]


def test_query_and_key_rebound_to_their_projections_are_read_as_the_layer_was_handed_them():
    """The Annotated Transformer writes `query, key, value = [lin(x).view(...) ... for lin, x in zip(...)]`: by the time
    the kernel runs, the forward's `query` and `key` are two projections, other tensors whatever the attention. Read as
    nn.Module's call handed them (its args and kwargs; with a forward hook set too, where forward runs in a closure):
    `self_attn(x, x, x)` is self, `src_attn(x, m, m)` cross."""

    class MultiHeadedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, query, key, value, mask=None):
            query, key, value = [lin(x).view(x.shape[0], -1, 2, 4).transpose(1, 2)
                                 for lin, x in zip(self.linears, (query, key, value))]
            scores = query @ key.transpose(-2, -1) / 2.0
            if mask is not None:
                scores = scores.masked_fill(mask == 0, -1e9)
            return (scores.softmax(-1) @ value).transpose(1, 2).reshape(query.shape[0], -1, 8)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.src_attn = MultiHeadedAttention(), MultiHeadedAttention()

        def forward(self, x, m):
            x = self.self_attn(x, x, x, torch.ones(6, 6).tril())
            return self.src_attn(x, m, m)

    torch.manual_seed(0)
    layer = Layer().eval()
    x, m = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    for hooked in (False, True):
        if hooked:
            layer.self_attn.register_forward_pre_hook(lambda module, args: None)
            layer.src_attn.register_forward_hook(lambda module, args, out: None)
        with torch.no_grad():
            found = _crossings(lambda: layer(x, m))
        assert found == {"self_attn": {(False, "inputs")}, "src_attn": {(True, "inputs")}}, hooked


def test_a_packed_kv_holding_the_layers_own_keys_is_self_attention(tmp_path):
    """flash-attn's MHA hands its self-attention's cache to `inner_cross_attn(q, kv)`: kv ends with the packed qkv's
    own keys and values, so the call is read as self-attention (checks/context.crossing), not cross."""
    import json

    from checkbugs import traced

    traced(tmp_path, "hnet_kvcache_decode_drops_sliding_window", True)
    data = json.loads((tmp_path / "hnet_kvcache_decode_drops_sliding_window-fixed.json").read_text())
    prefill = data["calls"][0]
    assert prefill["where"] == "layers.0.mixer.inner_cross_attn" and prefill["details"]["cross"]["cross"] is False


def test_a_packed_kv_is_the_queries_own_only_where_it_ends_with_their_packed_keys():
    """trace/crossing._packed_own: kv (B, S', 2, H, D) whose last S rows equal the packed qkv's keys and values (the
    queries' `qkv[:, :, 0]` base) is the layer's own; a kv of other values, or a query with no packed base, is not."""
    from maskcli.trace.crossing import _packed_own

    torch.manual_seed(0)
    qkv = torch.randn(1, 5, 3, 2, 4)
    q = qkv[:, :, 0]
    own = torch.cat([torch.randn(1, 3, 2, 2, 4), qkv[:, :, 1:]], dim=1)  # a cache of 3 earlier keys, then its own
    assert _packed_own(q, own) and _packed_own(q, qkv[:, :, 1:].clone())
    assert not _packed_own(q, torch.randn(1, 8, 2, 2, 4))  # an encoder's memory, packed the same way
    assert not _packed_own(torch.randn(1, 5, 2, 4), own)  # a query of its own storage: nothing packed to compare


def test_a_forward_of_x_and_y_read_by_its_first_two_hidden_states():
    """torchtune's MultiHeadAttention.forward(x, y, mask): handed (h, encoder_out) of other lengths it is a
    cross-attention, handed (h, h) a self-attention; two of equal lengths, or a y that is no (B, L, D) hidden state of
    x's batch and width (a position table), say nothing."""
    import torch.nn.functional as F

    class MultiHeadAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y, mask=None):
            q, k = self.q_proj(x)[:, None], self.k_proj(y)[:, None]
            return F.scaled_dot_product_attention(q, k, k, attn_mask=mask)

    ca, sa, same = MultiHeadAttention(), MultiHeadAttention(), MultiHeadAttention()  # (one reading per call site)
    h = torch.randn(2, 5, 8)

    with maskcli.trace() as t:
        ca(h, torch.randn(2, 7, 8))
        sa(h, h)
        same(h, torch.randn(2, 5, 8))  # equal lengths: nothing said by the inputs
    readings = [crossing(call) for call in t.calls]
    assert (readings[0].cross, readings[0].by) == (True, "inputs")
    assert "y handed to MultiHeadAttention.forward()" in readings[0].source
    assert (readings[1].cross, readings[1].by) == (False, "inputs")
    assert readings[2].by != "inputs"


def test_a_forward_of_a_shard_and_the_whole_sequence_is_self_attention():
    """A context-parallel rank's layer handed its shard of the sequence and the whole one its keys are gathered from
    (Cornstarch's ContextParallelAttention(local_hidden_states, all_hidden_states)): x is a run of y's rows, a view of
    it or a copy, so the same tokens: not another sequence, though their lengths differ."""
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y, mask=None):
            q, k = self.q_proj(x)[:, None], self.k_proj(y)[:, None]
            return F.scaled_dot_product_attention(q, k, k, attn_mask=mask)

    viewed, copied, other = Attention(), Attention(), Attention()
    whole = torch.randn(2, 12, 8)
    with maskcli.trace() as t:
        viewed(whole[:, 4:8], whole)  # rank 1 of 3: a view of the whole
        copied(whole[:, 8:].clone(), whole)  # rank 2: the same values in its own storage
        other(whole[:, 8:] + 1, whole)  # values the whole does not hold: another sequence
    readings = [crossing(call) for call in t.calls]
    assert [r.cross for r in readings[:2]] == [False, False]
    assert (readings[2].cross, readings[2].by) == (True, "inputs")


def test_a_layer_of_no_weights_handed_queries_and_keys_is_read_by_their_lengths():
    """d2l's DotProductAttention(queries, keys, values) holds no weights: what it is handed was projected before it, so
    its queries and keys are other tensors in a self-attention too. Keys of another length than the queries (no cache)
    are another sequence's; of the same length they say nothing; inside a layer with weights, that layer is asked
    first (its own query and key are the queries' tensor: self)."""

    class DotProductAttention(nn.Module):
        def forward(self, queries, keys, values):
            return F.scaled_dot_product_attention(queries[:, None], keys[:, None], values[:, None])[:, 0]

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 24)
            self.inner = DotProductAttention()

        def forward(self, query, key):
            q, k, v = self.proj(key).chunk(3, dim=-1)
            return self.inner(self.proj(query).chunk(3, dim=-1)[0], k, v)

    bare, outer = DotProductAttention(), SelfAttention().eval()
    x, y = torch.randn(2, 4, 8), torch.randn(2, 6, 8)
    with torch.no_grad():
        assert _crossings(lambda: bare(x, y, y)) == {"DotProductAttention": {(True, "inputs")}}
        assert _crossings(lambda: bare(x, torch.randn(2, 4, 8), torch.randn(2, 4, 8))) == {"DotProductAttention": {(False, "none")}}
        assert _crossings(lambda: outer(x, x)) == {"inner": {(False, "inputs")}}


def test_a_memory_handed_as_an_object_or_a_dict_of_its_projected_keys():
    """Dia's DecoderLayer.forward(x, ..., cross_attn_cache, ...) hands its attention helper the keys of a KVCache
    object (a `cross_kv` dict, written another way): cross where the helper holds one of its tensors as long as the
    keys; the self-attention beside it, over its own cache, reads as before (a `cross_*` that holds no such keys)."""

    class Cache:
        def __init__(self, k, v):
            self.k, self.v = k, v

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, own, cross_attn_cache):
            q = self.proj(x)[:, None]
            x = attend(q, own["k"], own["v"])[:, 0]
            memory = cross_attn_cache if isinstance(cross_attn_cache, dict) else vars(cross_attn_cache)
            return attend(q, memory["k"], memory["v"])

    layer, own = Layer(), {"k": torch.randn(2, 1, 4, 8), "v": torch.randn(2, 1, 4, 8)}
    for memory in (Cache(torch.randn(2, 1, 7, 8), torch.randn(2, 1, 7, 8)),
                   {"k": torch.randn(2, 1, 7, 8), "v": torch.randn(2, 1, 7, 8)}):
        with torch.no_grad(), maskcli.trace() as t:
            layer(torch.randn(2, 1, 8), own, memory)
        said = [(c.shape[3], crossing(c).cross) for c in t.calls]
        assert said == [(4, False), (7, True)], said
        name = "cross_attn_cache['k']" if isinstance(memory, dict) else "cross_attn_cache.k"
        assert crossing(t.calls[1]).source.startswith(f"{name} handed to Layer.forward()"), crossing(t.calls[1]).source
