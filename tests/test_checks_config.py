"""checks/config.py: each layer's mask against the model's config as transformers reads it, on reproductions of
published bugs (tiny Hugging Face models whose registered attention function carries the bug)."""

from __future__ import annotations

import pytest

from checkbugs import check_bug
from maskcli.checks.config import layer_kind


def test_a_models_own_config_without_transformers(tmp_path):
    # ml-explore/mlx-lm#390: the window mask one key too wide, the window read from a plain torch model's config
    check_bug(tmp_path, "window_mask_one_too_many", "window-off-by-one")

BUGS = [
    ("hf_window_off_by_one", "window-off-by-one"),  # huggingface/transformers#39408: window_size=(W, W)
    ("hf_window_ignored", "window-missing"),  # unslothai/unsloth#8253: the window never reached SDPA
    ("hf_qwen2_window_layers", "window-on-full-layer"),  # huggingface/transformers#35924, fixed by #36162
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    pytest.importorskip("transformers")
    check_bug(tmp_path, name, code)


def test_layer_kinds_are_read_as_transformers_reads_them():
    """Qwen2's layer_types come from use_sliding_window and max_window_layers (transformers/models/qwen2/
    configuration_qwen2.py lines 87-91: sliding where i >= max_window_layers); a config without layer_types is
    sliding wherever sliding_window is set and use_sliding_window is not False."""
    transformers = pytest.importorskip("transformers")
    MistralConfig, Qwen2Config = transformers.MistralConfig, transformers.Qwen2Config

    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    expected = ["sliding_attention" if i >= qwen.max_window_layers else "full_attention" for i in range(4)]
    assert [layer_kind(qwen, i)[0] for i in range(4)] == expected
    assert layer_kind(qwen, 4) is None

    class Old:  # a config of transformers 4, before layer_types
        sliding_window = 4096
        use_sliding_window = False

    assert layer_kind(Old(), 0)[0] == "full_attention"
    Old.use_sliding_window = True
    assert layer_kind(Old(), 3) == ("sliding_attention", "sliding_window=4096")
    assert layer_kind(MistralConfig(sliding_window=None), 0)[0] == "full_attention"
