"""maskcli.hf.layers: each layer type's window or chunk, read against the config classes' own attributes."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers", reason="serve --model reads configs with transformers (the hf extra)")


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "llama4_text"])
def test_layer_masks_are_the_config_classes_own(family):
    from maskcli.hf.layers import layer_masks

    config = transformers.AutoConfig.for_model(family)
    config = config.get_text_config()
    masks, types = layer_masks(family)
    assert len(types) == config.num_hidden_layers
    for kind in set(types):
        if kind == "sliding_attention":
            assert masks[kind] == ("window", config.sliding_window)
        elif kind == "chunked_attention":
            assert masks[kind] == ("chunk", config.attention_chunk_size)
        else:
            assert masks[kind] == ("full", None)


def test_a_config_file_sets_the_window(tmp_path):
    from maskcli.hf.layers import layer_masks

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": 6, "num_hidden_layers": 2}))
    assert layer_masks(str(path)) == ({"sliding_attention": ("window", 6)}, ["sliding_attention"] * 2)
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": None, "num_hidden_layers": 2}))
    assert layer_masks(str(path))[0] == {"full_attention": ("full", None)}
