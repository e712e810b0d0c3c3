"""checks/items.py (and trace/tops.py's grid_thw and image lists): a vision tower's images, or a video's frames,
seeing each other in one sequence."""

from __future__ import annotations

from pathlib import Path

import torch

import pytest

from checkbugs import check_bug, traced
from maskcli.checks.items import _patches

HERE = Path(__file__).parent / "data" / "items"


def test_patches_per_axis_are_the_convolutions_output_size():
    for kernel, stride, padding, size in ((4, 4, 0, 12), (4, 4, 0, 14), (3, 2, 1, 9), (14, 14, 0, 28)):
        conv = torch.nn.Conv2d(1, 1, kernel, stride, padding)
        reference = conv(torch.zeros(1, 1, size, size)).shape[-1]
        assert _patches(size, (kernel, stride, padding, 1, False)) == reference


def test_vllm_hunyuan_ocr_images_concatenated_unmasked(tmp_path):
    """vllm-project/vllm#30344: every image's patches in one unmasked sequence (grid_thw)."""
    [hit] = check_bug(tmp_path, "vllm_hunyuan_ocr_vit_images_concatenated_attend_each_other", "items-joined")
    assert hit["message"].startswith("patch 0 (image 0) sees patch 24 of image 1 in one sequence of 32 patches")
    assert "grid_thw [(1, 4, 6), (1, 2, 4)]" in hit["message"]


def test_eole_hunyuan_ocr_batch_without_block_mask(tmp_path):
    """eole-nlp/eole#280: a list of images of three sizes, mask=None (patches from the patch convolution's stride)."""
    [hit] = check_bug(tmp_path, "eole_hunyuan_ocr_vision_encoder_batch_without_block_mask", "items-joined")
    assert "3 images of 12x16, 8x8, 16x16 pixels, 12, 4, 16 patches" in hit["message"]


def test_sglang_qwen3_vl_cu_seqlens_join_a_videos_frames(tmp_path):
    """sgl-project/sglang#11458: cu_seqlens from t * h * w, the video's two temporal patches one segment."""
    [hit] = check_bug(tmp_path, "sglang_qwen3vl_vit_cu_seqlens_joins_video_frames", "items-joined")
    assert hit["message"].startswith("patch 0 (frame 0) sees patch 16 of frame 1 of the same video")
    # (the program's own class names the family; it is the reference encoder, not this tower, that attends per frame)
    assert "as the reference encoder of the family Qwen3_VisionTransformer names does" in hit["message"]


def test_a_prefix_mask_over_image_grid_thw_written_another_way(tmp_path):
    """An additive float mask, `image_grid_thw` by keyword, three images: each sees the images before it."""
    [hit] = check_bug(tmp_path, "tower_grid_additive_prefix", "items-joined", HERE)
    assert hit["message"].startswith("patch 0 (image 0) sees patch 6 of image 1 in one sequence of 19 patches")


def test_one_call_per_segment_placed_in_order(tmp_path):
    """A loop of SDPA calls over cu_seqlens (vLLM's per-segment path): the video's segment is one call of 24 keys."""
    [hit] = check_bug(tmp_path, "vllm_style_qwen25_video_segments", "items-joined", HERE)
    assert hit["message"].startswith("patch 0 (frame 0) sees patch 8 of frame 1 of the same video")


def test_quiet_on_transformers_qwen2_vl_with_an_image_and_a_video(tmp_path):
    pytest.importorskip("transformers")  # (its Qwen2-VL: the hf extra)
    status, found, report = traced(tmp_path, "hf_qwen2_vl_image_and_video", False, HERE)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_quiet_on_joint_views_of_one_size_and_a_temporal_module(tmp_path):
    status, found, report = traced(tmp_path, "multiview_views_and_temporal_frames", False, HERE)
    assert status == 0 and [f for f in found if f["code"] == "items-joined"] == [], report


def test_sglang_jax_qwen25vl_cu_seqlens_only_a_flag(tmp_path):
    """sgl-project/sglang-jax#1289: cu_seqlens used only as a flag, the full-attention blocks run unmasked over an image
    of 16 patches and a video of two 16-patch frames (grid_thw [(1, 4, 4), (2, 4, 4)]), caught before blind-am's tuning."""
    found = check_bug(tmp_path, "sglang_jax_qwen25vl_vit_cu_seqlens_unused_as_mask", "items-joined")
    assert "patch 12 (image 0) sees patch 16 of image 1 in one sequence of 48 patches" in found[0]["message"]
