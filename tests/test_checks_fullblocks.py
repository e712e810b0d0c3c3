"""checks/fullblocks.py (and trace/stated.py's fullatt_block_indexes, trace/tops.py's cu_window_seqlens): a vision
tower whose full-attention blocks and windowed blocks see one mask, or whose full blocks see less than the windowed ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, traced
from maskcli.checks.fullblocks import _segments

HERE = Path(__file__).parent / "data" / "fullblocks"


def test_segments_are_the_loops_block_diagonal():
    cu = np.array([0, 3, 4, 9])
    reference = np.array([[any(a <= q < b and a <= k < b for a, b in zip(cu[:-1], cu[1:])) for k in range(9)]
                          for q in range(9)])
    assert np.array_equal(_segments(cu, 9), reference)
    assert _segments(cu, 10) is None  # segments that do not span the sequence: not read


def test_cosmos_rl_string_keys_never_select_the_full_blocks(tmp_path):
    """nvidia-cosmos/cosmos-rl#171: `layer_num in self.fullatt_block_indexes` with str ModuleDict keys."""
    [hit] = check_bug(tmp_path, "cosmos_rl_qwen2_5_vl_fullatt_block_string_key_never_full", "full-blocks-windowed")
    assert "both run inside the windows (cu_window_seqlens)" in hit["message"]


def test_vllm_window_blocks_given_the_image_seqlens(tmp_path):
    """vllm-project/vllm#15200: xformers' BlockDiagonalMask built from the full-image seqlens for every block."""
    [hit] = check_bug(tmp_path, "vllm_qwen2_5_vl_xformers_window_layers_full_image_seqlens", "full-blocks-windowed")
    assert "both run over the whole image (cu_seqlens)" in hit["message"]


def test_a_mask_cache_keyed_by_length_written_another_way(tmp_path):
    """A dataclass config, a ModuleList, additive float masks cached by token count: the full block reuses a window's."""
    [hit] = check_bug(tmp_path, "tower_mask_cache", "full-blocks-windowed", HERE)
    assert hit["message"].startswith("block 1 is a full-attention block (self.fullatt_block_indexes=[1] of Tower)")


def test_windows_cut_inside_forward_are_only_suspicious(tmp_path):
    """Without both segmentations among the model call's arguments each image may be one window: suspicious."""
    status, found, report = traced(tmp_path, "tower_mask_cache", False, HERE, ("--inside",))
    assert [(f["code"], f["severity"]) for f in found] == [("full-blocks-windowed", "suspicious")], report
    assert "unless every image fits inside one window" in found[0]["message"]
    status, found, report = traced(tmp_path, "tower_mask_cache", True, HERE, ("--inside",))
    assert found == [] and status == 0, report


def test_quiet_where_each_image_is_one_window(tmp_path):
    """cu_window_seqlens equal to cu_seqlens: the full and windowed blocks rightly share one mask."""
    status, found, report = traced(tmp_path, "tower_mask_cache", False, HERE, ("--one-window",))
    assert [f for f in found if f["code"] == "full-blocks-windowed"] == [] and status == 0, report


def test_transformers_tower_with_a_port_s_whole_image_windows(tmp_path):
    """transformers' own Qwen2.5-VL vision tower, its window index replaced by whole images: the config's window_size
    over patch_size (64 patches) says the windowed blocks' 256 keys are too many."""
    pytest.importorskip("transformers")  # (its Qwen2_5_VisionTransformerPretrainedModel: the hf extra)
    [hit] = check_bug(tmp_path, "hf_qwen25_vision_windows_lost", "full-blocks-windowed", HERE)
    assert "sees 256 keys, more than the 64 patches of one window (window_size=112 over patch_size=14" in hit["message"]


def test_transformers_tower_quiet_on_an_image_of_one_window(tmp_path):
    """An 8 x 8-patch image is one window of the config's: every block rightly sees all of it."""
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "hf_qwen25_vision_windows_lost", False, HERE, ("--one",))
    assert [f for f in found if f["code"] == "full-blocks-windowed"] == [] and status == 0, report


def test_pai_megatron_full_and_window_seqlens_swapped(tmp_path):
    """alibaba/Pai-Megatron-Patch#552: the frame cu_seqlens handed to the window layers and the window ones to the
    full layers: the full blocks see a 4-patch window, the windowed blocks a 16-patch frame."""
    [hit] = check_bug(tmp_path, "pai_megatron_qwen25vl_vision_full_and_window_seqlens_swapped", "full-blocks-windowed")
    assert "block 1 is a full-attention block (self.fullatt_block_indexes=[1, 3] of Qwen2_5VisionModel)" in hit["message"]
    assert "at most 4 keys a query against 16" in hit["message"]


def test_an_inverted_choice_over_two_images_written_another_way(tmp_path):
    """Two images of 16 and 8 patches, an explicit softmax with -inf fills, `cu_window if number in
    self.fullatt_block_indexes else cu_image`: the full blocks 3 and 7 see windows of 4 patches, the others an image."""
    [hit] = check_bug(tmp_path, "tower_inverted_choice", "full-blocks-windowed", HERE)
    assert hit["message"].startswith("block 3 is a full-attention block (self.fullatt_block_indexes=[3, 7] of VisionTower)")
    assert "segments are swapped" in hit["message"]
