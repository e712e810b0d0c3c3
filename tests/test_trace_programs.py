"""maskcli.trace on small versions of real programs, written as their projects write them (tests/programs/): every
attention call seen, each at its own call site and step, and every recorded mask the one the kernel applied
(checked against the program's own attention weights, or attention recomputed with the recorded mask)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn as nn

import maskcli

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))

import annotated_transformer as annotated  # noqa: E402


def test_the_annotated_transformers_encoder_and_decoder_called_on_their_own_are_separate_call_sites():
    """greedy_decode calls model.encode / model.decode (plain methods): no module of the program runs when the
    encoder and decoder are called, yet their layers are encoder.layers.N and decoder.layers.N, each with its steps."""
    torch.manual_seed(0)
    model = annotated.make_model(11, 11, N=2, d_model=16, d_ff=32, h=2).eval()
    src = torch.LongTensor([[1, 2, 3, 4, 5, 6, 0, 0]])
    src_mask = (src != 0).unsqueeze(-2)
    with maskcli.trace() as t:
        annotated.greedy_decode(model, src, src_mask, max_len=4, start_symbol=0)
    sites = [(c.where, c.step, c.shape[2:]) for c in t.calls]
    encoder = [(f"encoder.layers.{n}.self_attn", 0, (8, 8)) for n in range(2)]
    decoder = [(f"decoder.layers.{n}.{attn}", step, (step + 1, step + 1 if attn == "self_attn" else 8))
               for step in range(3) for n in range(2) for attn in ("self_attn", "src_attn")]
    assert sites == encoder + decoder  # 2 + 3 steps x 2 layers x 2: every call, none twice
    for call in t.calls:
        keep = call.keep()
        q_len, k_len = call.shape[2:]
        for b, h, i, j in np.ndindex(keep.shape):  # padding (blank = 0) for the source's keys; causal for the target's
            wanted = j <= i if call.where.endswith("self_attn") and call.where.startswith("decoder") else j < 6
            assert keep[b, h, i, j] == wanted, (call.where, call.step, i, j)
    for layer in (*model.encoder.layers, *model.decoder.layers):  # the last call of each: the weights it computed
        for attn in (layer.self_attn, getattr(layer, "src_attn", None)):
            if attn is None:
                continue
            last = [c for c in t.calls if c.where.endswith(_path(model, attn))][-1]
            assert np.array_equal(np.broadcast_to(last.keep(), attn.attn.shape), (attn.attn > 0).numpy())


def _path(model, module) -> str:
    return next(name for name, inner in model.named_modules() if inner is module)


def test_pytorchs_translation_tutorial_names_encoder_and_decoder_layers_apart():
    """The tutorial's Seq2SeqTransformer.encode / decode call self.transformer.encoder / .decoder on their own."""
    import translation_transformer as tutorial

    model = tutorial.make_model()
    with maskcli.trace() as t:
        tutorial.translate(model, [5, 6, 7, 8], max_len=4)
    steps = len(t.calls[2:]) // 4
    assert [(c.where, c.step) for c in t.calls] == [(f"transformer.encoder.layers.{n}.self_attn", 0) for n in range(2)] + [
        (f"transformer.decoder.layers.{n}.{attn}", step) for step in range(steps) for n in range(2) for attn in ("self_attn", "multihead_attn")]
    for call in t.calls:
        keep = call.keep()
        causal = call.where.endswith("decoder.layers.0.self_attn") or call.where.endswith("decoder.layers.1.self_attn")
        for b, h, i, j in np.ndindex(keep.shape):
            assert keep[b, h, i, j] == (j <= i if causal else True), (call.where, i, j)


def test_two_instances_of_one_module_class_are_two_call_sites_each_with_its_steps():
    torch.manual_seed(0)
    first, second = nn.MultiheadAttention(8, 2).eval(), nn.MultiheadAttention(8, 2).eval()
    x = torch.randn(3, 1, 8)
    with maskcli.trace() as t:
        first(x, x, x)
        second(x, x, x)
        first(x, x, x)
    assert [(c.where, c.step) for c in t.calls] == [("MultiheadAttention", 0), ("second", 0), ("MultiheadAttention", 1)]
    pair = [nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2)]
    with maskcli.trace() as t:
        pair[0](x, x, x)
        pair[1](x, x, x)  # no variable holds either: the later one is numbered
    assert [(c.where, c.step) for c in t.calls] == [("MultiheadAttention", 0), ("MultiheadAttention#2", 0)]


def test_a_second_module_attending_in_its_own_forward_is_named_by_the_programs_variable():
    """The frames are read at the attention call, inside the module's own forward, where `self` holds it: the name is
    still the variable of the program's that holds it (here `cross`), not its class numbered."""
    class Attend(nn.Module):
        def forward(self, q, k):
            return torch.nn.functional.scaled_dot_product_attention(q, k, k)

    first, cross = Attend(), Attend()
    x = torch.randn(1, 2, 3, 4)
    with maskcli.trace() as t:
        first(x, x)
        cross(x, torch.randn(1, 2, 5, 4))
    assert [c.where for c in t.calls] == ["Attend", "cross"]


def _causal(call) -> bool:
    q_len, k_len = call.shape[2:]
    return np.array_equal(np.broadcast_to(call.keep(), call.shape)[0, 0], np.tril(np.ones((q_len, k_len), dtype=bool)))


def test_mingpts_softmax_over_logits_is_no_attention_call():
    """minGPT's CausalSelfAttention softmaxes q @ kᵀ; a user's F.softmax(logits) over (B, T, vocab) is not attention:
    2 layers x 3 forwards (scoring the prompt, then 2 generated tokens) make 6 calls, no more."""
    import mingpt

    with maskcli.trace() as t:
        mingpt.main()
    assert [(c.where, c.step, c.shape) for c in t.calls] == [
        (f"transformer.h.{n}.attn", step, (1, 2, length, length)) for step, length in enumerate((5, 5, 6)) for n in range(2)]
    assert all(c.api == "softmax" and _causal(c) for c in t.calls)


def test_nanogpts_flash_and_slow_paths_are_seen_alike_and_compute_alike():
    import nanogpt

    found = {}
    for flash in (True, False):
        with maskcli.trace() as t:
            tokens = nanogpt.sample(flash=flash)
        found[flash] = tokens
        assert [(c.where, c.step, c.shape[2]) for c in t.calls] == [
            (f"transformer.h.{n}.attn", step, 3 + step) for step in range(3) for n in range(2)]
        assert all(c.api == ("sdpa" if flash else "softmax") and _causal(c) for c in t.calls)
    assert torch.equal(found[True], found[False]) and torch.equal(found[True], nanogpt.sample())  # untraced alike


def test_nn_transformer_told_tgt_is_causal_with_no_mask_attends_to_every_key_on_its_fast_path():
    """nn.Transformer hands tgt_is_causal to its decoder layers' self_attn; in eval with no grad, batch first, that
    nn.MultiheadAttention takes its fast path (torch/nn/modules/activation.py 1398-1447, torch 2.13), which never
    reads is_causal: with no tgt_mask the decoder attends to later tokens. The trace records no mask and says why."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                           batch_first=True).eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    with torch.no_grad():
        with maskcli.trace() as t:
            out = model(src, tgt, tgt_is_causal=True)
        unmasked = model(src, tgt)
        causal = model(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(4), tgt_is_causal=True)
    assert torch.allclose(out, unmasked, atol=1e-6) and not torch.allclose(out, causal, atol=1e-3)  # the hint did nothing
    assert [c.where for c in t.calls] == ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"]
    assert all(c.keep().all() for c in t.calls)
    (finding,) = t.groups()[1].findings
    assert finding.code == "ignored-is-causal" and "no mask was applied" in finding.message
