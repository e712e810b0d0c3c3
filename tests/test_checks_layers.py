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


class Parts:
    """A vision-language model's config of parts, as transformers' Gemma3Config is: no layer field of its own, the text
    model's fields in text_config (get_text_config), the vision tower's in another part."""

    def __init__(self, text_config, vision_config):
        self.text_config, self.vision_config = text_config, vision_config

    def get_text_config(self, decoder=None):
        return self.text_config


class Tower(torch.nn.Module):
    """Two vision layers, both ways over 4 patches, holding the vision part of the config."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(Layer(None) for _ in range(2))

    def forward(self, x):
        for one in self.layers:
            x = x + one(x)
        return x


class VisionLanguage(torch.nn.Module):
    """The top module holds the config of parts; its language model the text part (self.config), as transformers'
    Gemma3ForConditionalGeneration and its language_model do."""

    def __init__(self, config, masks):
        super().__init__()
        self.config = config
        self.vision_tower = Tower(config.vision_config)
        self.language_model = Model(config.text_config, masks)

    def forward(self, patches, x):
        self.vision_tower(patches)
        return self.language_model(x)


def test_a_config_of_parts_speaks_through_the_text_part_its_language_model_holds():
    # five sliding layers and a full one, as the text part's layer_types say: quiet (the config of parts states no
    # layer field itself, and was read as "every layer full", so the full layer was called different from its kind)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    text = Config(num_hidden_layers=6, sliding_window=2, layer_types=types)
    masks = [window(2) if kind == "sliding_attention" else causal() for kind in types]
    with maskcli.trace() as t, torch.no_grad():
        VisionLanguage(Parts(text, Config(num_hidden_layers=2, image_size=28)), masks)(
            torch.randn(1, 1, 4, 4), torch.randn(1, 1, 6, 4))
    found = [(f.code, severity(f), f.message) for group in t.groups() for f in group.findings]
    assert not [f for f in found if f[1] == "wrong"], found
    # the same model with one sliding layer handed the full layer's mask: the text part's layer types still speak
    masks[1] = causal()
    with maskcli.trace() as t, torch.no_grad():
        VisionLanguage(Parts(text, Config(num_hidden_layers=2, image_size=28)), masks)(
            torch.randn(1, 1, 4, 4), torch.randn(1, 1, 6, 4))
    wrong = [f for group in t.groups() for f in group.findings if severity(f) == "wrong"]
    assert wrong and "layer 1" in wrong[0].message, [f.message for f in wrong]


def test_mlx_vlm_gemma3_masks_built_from_the_cache_list_lose_the_window(tmp_path):
    """Blaizzy/mlx-vlm be852ea6 (#681; written blind, blind-vd, caught before any rule changed for it): Gemma3Model built
    its masks from slices of the per-layer cache list, which has no make_mask(), and passed no window, so the local
    layers of a 12-token prompt got the plain causal mask. The reference: layers i with (i + 1) % 3 != 0 are local
    (sliding_window_pattern 3, 6 layers), each of them said, and none of the global ones."""
    found = check_bug(tmp_path, "mlx_vlm_gemma3_prefill_masks_from_cache_list_no_window", "window-missing")
    local = [i for i in range(6) if (i + 1) % 3 != 0]
    said = sorted({int(f["message"].split()[1]) for f in found})
    assert said == local, found
    assert all("sliding_window=4" in " ".join(f["message"].split()) for f in found), found
