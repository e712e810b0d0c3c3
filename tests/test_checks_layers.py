"""checks/layers.py: layers of one layer type get one mask, on reproductions of published bugs (a layer of a type handed
another mask in packed batches, where no config rule rebuilds the masks), and quiet where layers differ by the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug
from maskcli.checks.layers import types_known
from maskcli.checks.registry import severity

BUGS = [
    ("nemo_gemma2_first_layer_window", "layer-differs"),  # NVIDIA-NeMo/Speech#9672 (NeMo): layer 0 read a clamped number
    ("vllm_gpt_oss_even_odd_windows", "layer-differs"),  # vllm-project/vllm#33594: windows by even index, not layer_types
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


class Config:
    """A model's config as a plain object (any module's `config` attribute is read: checks/context.py)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class Model(torch.nn.Module):
    """Layers that each apply the mask `masks[i]` (a bool keep tensor built in the test) through SDPA."""

    def __init__(self, config, masks):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(Layer(mask) for mask in masks)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Layer(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=self.mask)


def findings(config, masks, length=6):
    with maskcli.trace() as t, torch.no_grad():
        Model(config, masks)(torch.randn(1, 1, length, 4))
    return [(f.code, severity(f), f.message)
            for group in t.groups() for f in group.findings]


def causal(length=6):
    return torch.ones(length, length, dtype=torch.bool).tril()  # keep: key <= query


def window(size, length=6):
    return causal(length) & ~torch.ones(length, length, dtype=torch.bool).tril(-size)  # keep: query - key < size


def test_one_full_layer_of_four_with_another_mask_is_wrong_and_says_whose_mask_the_others_have():
    # a Llama-style config: no window, no layer types, so every layer is a full-attention one (config.py's layer_kind)
    found = findings(Config(num_hidden_layers=4), [causal(), causal(), window(2), causal()])
    wrong = [f for f in found if f[0] == "layer-differs"]
    assert len(wrong) == 1 and wrong[0][1] == "wrong", found
    assert "layer 2 is full_attention" in wrong[0][2] and "layers 0-1, 3" in wrong[0][2] and "(causal)" in wrong[0][2]
    # the first differing cell: query 2 sees key 0 under causal, not under window(2) (keep[2, 0] above)
    assert "query 2 of batch row 0 does not see key 0" in wrong[0][2], wrong


def test_layers_that_differ_as_layer_types_say_are_quiet():
    # Gemma 3's pattern (transformers configuration_gemma3.py: sliding where (i + 1) % 6): five windows, one full layer
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(6)]
    masks = [window(2) if kind == "sliding_attention" else causal() for kind in types]
    found = findings(Config(num_hidden_layers=6, sliding_window=2, layer_types=types), masks)
    assert [f for f in found if f[1] != "note"] == [], found


def test_no_strict_majority_and_no_config_are_quiet():
    assert not [f for f in findings(Config(num_hidden_layers=2), [causal(), window(2)]) if f[0] == "layer-differs"]
    # a hand-written model with no config: five windows and one full layer may be meant (Gemma 3's own pattern)
    with maskcli.trace() as t, torch.no_grad():
        x = torch.randn(1, 1, 6, 4)
        torch.nn.Sequential(*[Layer(window(2)) for _ in range(5)], Layer(causal()))(x)
    assert not [f for group in t.groups() for f in group.findings if f.code == "layer-differs"]


def test_a_layer_the_config_rule_reports_is_reported_once():
    # the first layer of three sliding ones given no window, one document: config.py's window-missing says it
    types = ["sliding_attention"] * 3
    found = findings(Config(num_hidden_layers=3, sliding_window=2, layer_types=types), [causal(), window(2), window(2)])
    codes = [f[0] for f in found if f[1] == "wrong"]
    assert codes == ["window-missing"], found


def test_layer_types_are_known_only_where_the_config_has_no_other_per_layer_field():
    assert types_known(Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]))
    assert types_known(Config(num_hidden_layers=4, sliding_window=8))  # Mistral: every layer sliding
    # GPT-Neo (configuration_gpt_neo.py: attention_layers from attention_types), ModernBERT's interval, old Qwen2
    assert not types_known(Config(num_hidden_layers=2, attention_layers=["global", "local"], window_size=256))
    assert not types_known(Config(num_hidden_layers=4, global_attn_every_n_layers=3))
    assert not types_known(Config(num_hidden_layers=4, sliding_window=8, max_window_layers=2))
    assert not types_known(Config(num_hidden_layers=3, window_sizes=[4, None, 4]))
