"""trace/owndecoder.py: each module of the program's own class that keeps a bool is_decoder, for the calls under it."""

from __future__ import annotations

import torch

from maskcli.checks.intent import stated_for
from maskcli.checks.context import Top
from maskcli.trace.owndecoder import own_decoders


class _Block(torch.nn.Module):
    def __init__(self, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.attn = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.attn(x)


class _Whole(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.is_decoder, self.is_encoder_decoder = True, True
        self.encoder = torch.nn.ModuleList([_Block(False)])
        self.decoder = torch.nn.ModuleList([_Block(True)])

    def forward(self, x):
        return x


def _path(root):
    names = {id(module): name for name, module in root.named_modules()}
    return lambda module: names.get(id(module))


def test_each_blocks_own_word_and_not_an_encoder_decoders_whole():
    model = _Whole()
    said = {one.scope: one.fields["causal_decoder"] for one in own_decoders(model, _path(model))}
    assert said == {"encoder.0": False, "decoder.0": True}  # (the whole says is_encoder_decoder: no word of its own)


def test_the_innermost_speaks_for_a_call_and_torchs_own_classes_say_nothing():
    model = _Whole()
    stated = tuple(own_decoders(model, _path(model)))
    top = Top("", None, {}, 0, 1, stated)
    decoder = [one for one in stated_for(top, "decoder.0.attn") if "causal_decoder" in one.fields]
    encoder = [one for one in stated_for(top, "encoder.0.attn") if "causal_decoder" in one.fields]
    assert [one.fields["causal_decoder"] for one in decoder] == [True]
    assert [one.fields["causal_decoder"] for one in encoder] == [False]
    layer = torch.nn.TransformerDecoderLayer(4, 1)
    layer.is_decoder = True  # (an attribute set on torch's own class: not the program's statement)
    assert own_decoders(layer, _path(layer)) == []
