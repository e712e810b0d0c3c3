"""maskcli.hf.layers: each layer type's mask as an expression against transformers' own mask functions (masking_utils),
read cell by cell on small configs written as config.json files; each layer type's window or chunk (serve --model)
against the config classes' own attributes; a size the config leaves unset, read both ways."""

from __future__ import annotations

import json

import pytest
import torch

from maskcli import build

transformers = pytest.importorskip("transformers", reason="shard/serve --model read configs with transformers (the hf extra)")
from transformers import masking_utils  # noqa: E402

from maskcli.errors import MaskError  # noqa: E402
from maskcli.hf.layers import expression, layer_masks  # noqa: E402


def cells_of(function, length: int) -> list[list[bool]]:
    b = h = torch.tensor(0)
    return [[bool(function(b, h, torch.tensor(q), torch.tensor(k))) for k in range(length)] for q in range(length)]


def test_gemma3_sliding_and_full_layers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3_text", "sliding_window": 3, "num_hidden_layers": 3,
                                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}))
    found, _, skipped = layer_masks(str(path), missing="error")
    assert list(found) == ["sliding_attention", "full_attention"] and skipped == []
    # masking_utils.py: sliding_window_causal_mask_function (line 132) and causal_mask_function
    references = {"sliding_attention": masking_utils.sliding_window_causal_mask_function(3),
                  "full_attention": masking_utils.causal_mask_function}
    for kind, mask in found.items():
        assert build(expression(mask), length=9).dense()[0, 0].tolist() == cells_of(references[kind], 9), kind


def test_llama4_chunked_layers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4_text", "attention_chunk_size": 4, "num_hidden_layers": 2,
                                "layer_types": ["chunked_attention", "full_attention"]}))
    found, _, _ = layer_masks(str(path), missing="error")
    reference = masking_utils.chunked_causal_mask_function(4, torch.tensor([0]))  # masking_utils.py:159, no left padding
    assert build(expression(found["chunked_attention"]), length=10).dense()[0, 0].tolist() == cells_of(reference, 10)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "llama4_text"])
def test_layer_masks_are_the_config_classes_own(family):
    config = transformers.AutoConfig.for_model(family)
    config = config.get_text_config()
    masks, types, _ = layer_masks(family)
    assert len(types) == config.num_hidden_layers
    for kind in set(types):
        if kind == "sliding_attention":
            assert masks[kind] == ("window", config.sliding_window)
        elif kind == "chunked_attention":
            assert masks[kind] == ("chunk", config.attention_chunk_size)
        else:
            assert masks[kind] == ("full", None)


def test_a_config_file_sets_the_window(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": 6, "num_hidden_layers": 2}))
    assert layer_masks(str(path)) == ({"sliding_attention": ("window", 6)}, ["sliding_attention"] * 2, [])
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": None, "num_hidden_layers": 2}))
    assert layer_masks(str(path))[0] == {"full_attention": ("full", None)}


def test_a_window_the_config_leaves_unset_is_full_for_serve_and_an_error_for_shard(tmp_path):
    """transformers builds no sliding overlay without a size (masking_utils: sliding_window None), so serve compares
    a batch with full attention there; shard needs each layer's mask, and says which field is missing."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3_text", "sliding_window": None, "num_hidden_layers": 2,
                                "layer_types": ["sliding_attention", "full_attention"]}))
    masks, types, _ = layer_masks(str(path), missing="full")
    assert masks == {"sliding_attention": ("full", None), "full_attention": ("full", None)}
    assert types == ["sliding_attention", "full_attention"]
    with pytest.raises(MaskError, match="its layers include sliding_attention but its config has no sliding_window"):
        layer_masks(str(path), missing="error")
