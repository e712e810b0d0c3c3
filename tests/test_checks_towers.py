"""checks/towers.py: a call under a multimodal model's media encoder, by its module path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from maskcli.checks.towers import in_tower


@pytest.mark.parametrize("where, inside", [
    ("model.audio_tower.layers.0.self_attn", True),  # Qwen2-Audio
    ("model.visual.blocks.3.attn", True),  # Qwen2-VL
    ("vision_model.encoder.layers.1.self_attn", True),  # SigLIP inside a VLM
    ("model.language_model.layers.0.self_attn", False),
    ("model.layers.0.self_attn", False),
    ("model.visualizer_head.attn", False),  # (a part named so only in part is no tower)
    ("", False),
])
def test_a_call_is_a_media_encoders_where_its_path_passes_through_a_tower(where, inside):
    assert in_tower(SimpleNamespace(where=where)) is inside


def test_a_call_with_no_module_path_is_no_towers():
    assert in_tower(SimpleNamespace(where=None)) is False
