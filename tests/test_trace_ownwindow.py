"""trace/ownwindow.py: each layer's own is_sliding / sliding_window, and checks/intent.py's Intent.kind reading it."""

from __future__ import annotations

import torch

from maskcli.checks.intent import Intent, Stated
from maskcli.trace.ownwindow import own_windows


class _Attention(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.sliding_window = window


class _Layer(torch.nn.Module):
    def __init__(self, index, window):
        super().__init__()
        self.is_sliding = index % 2 == 0
        self.sliding_window = window  # (every layer's, as Gemma 2's decoder layer keeps it)
        self.self_attn = _Attention(window if index % 2 == 0 else None)


def _path(root):
    names = {id(module): name for name, module in root.named_modules()}
    return lambda module: names.get(id(module))


def test_each_modules_own_word():
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(_Layer(i, 8) for i in range(2))})
    said = {one.scope: one.fields["layer_slides"] for one in own_windows(model, _path(model))}
    assert said == {"layers.0": True, "layers.0.self_attn": True, "layers.1": False, "layers.1.self_attn": False}


def test_kind_reads_the_innermost_word_where_a_config_states_the_window():
    config = Stated("self.config", "", {"sliding_window": 4, "max_window_layers": 2, "use_sliding_window": True,
                                        "transformers": False})
    full = Stated("self.sliding_window=None of layers.1.attn", "layers.1.attn", {"layer_slides": False})
    slides = Stated("self.is_sliding=True of layers.1", "layers.1", {"layer_slides": True})
    assert Intent([config]).kind(0) == ("full_attention", "max_window_layers=2", False)  # transformers' direction
    assert Intent([config, slides, full]).kind(0)[:2] == ("full_attention", "self.sliding_window=None of layers.1.attn")
    assert Intent([config, slides]).kind(3)[0] == "sliding_attention"
    # never over the layer_types a config lists, nor over a transformers config's max_window_layers
    listed = Stated("self.config", "", {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]})
    assert Intent([listed, full]).kind(1) == ("sliding_attention", "layer_types[1]", False)
    hf = Stated("self.config", "", {"sliding_window": 4, "max_window_layers": 1, "transformers": True})
    assert Intent([hf, full]).kind(1) == ("sliding_attention", "max_window_layers=1", False)
    # no window stated: the module's word alone expects nothing
    assert Intent([full]).kind(0) == ("full_attention", "no sliding_window, layer_types or attention_chunk_size", False)


class _KerasHubAttention(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        self.use_sliding_window_attention = index % 6 < 5  # (KerasHub's Gemma 3 backbone: five local, one global)
        self.sliding_window_size = 6


def test_kerashubs_per_layer_use_sliding_window_attention_is_its_word():
    """KerasHub's Gemma 3 (written blind, quiet-r139a, a false alarm before: window-missing on layer 5): its config dict
    states `use_sliding_window_attention=True` and `sliding_window_size` for the model, and each attention module holds
    its own `use_sliding_window_attention`, False on every sixth layer. That module's word decides its kind."""
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(_KerasHubAttention(i) for i in range(7))})
    said = {one.scope: one.fields["layer_slides"] for one in own_windows(model, _path(model))}
    assert said == {f"layers.{i}": i % 6 < 5 for i in range(7)}
    config = Stated("CONFIG", "", {"sliding_window_size": 6, "use_sliding_window_attention": True,
                                   "transformers": False})
    for i, one in enumerate(own_windows(model, _path(model))):
        assert Intent([config, one]).kind(i)[0] == ("sliding_attention" if i % 6 < 5 else "full_attention")
