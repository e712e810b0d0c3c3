"""checks/flatgrid.py: a multimodal-rope model handed (B, L) position_ids over an image of more than one token."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, traced

pytest.importorskip("transformers")

BLIND = Path(__file__).parent / "data" / "blind"
FLATGRID = Path(__file__).parent / "data" / "flatgrid"


def test_verl_dataset_builds_text_positions_for_a_qwen2vl_processor_of_another_class_name(tmp_path):
    """verl-project/verl#1947 (written blind, blind-qe, caught after tuning): RLHFDataset builds Qwen2-VL's 3-D rope
    ids only for an image processor class named exactly Qwen2VLImageProcessor; the PIL one gets `position_ids` from the
    padding, (B, L). Batch row 0 is left-padded by 21: its image's 6 tokens (24-29) sit at positions 3-8 in t, h and
    w alike."""
    [hit] = check_bug(tmp_path, "verl_rl_dataset_qwen2vl_processor_name_check_text_positions", "flat-image-positions",
                      BLIND)
    assert tuple(hit["cell"]) == (0, 24, 24) and "image tokens 24-29 (id 5) are at positions 3-8" in hit["message"], hit


def test_a_qwen25vl_collator_that_counts_positions_from_the_padding(tmp_path):
    """Written another way: a Qwen2.5-VL fine-tuning step handed `attention_mask.cumsum(-1) - 1` beside two images
    (grids 1x4x6 and 1x4x4, merged 2x2: 6 and 4 tokens); row 0's image tokens follow its two text tokens and the
    vision start, 3-8. --fixed hands no position_ids (the model computes the grid): quiet."""
    [hit] = check_bug(tmp_path, "qwen25vl_sft_positions_from_padding_cumsum", "flat-image-positions", FLATGRID)
    assert tuple(hit["cell"]) == (0, 3, 3) and "(2, 13)" in hit["message"], hit


def test_text_only_positions_handed_to_a_multimodal_rope_model_are_quiet(tmp_path):
    """The same step over text alone (no image tokens, no grid): (B, L) positions are what transformers expands for
    text, which counts on in t, h and w alike."""
    text = (FLATGRID / "qwen25vl_sft_positions_from_padding_cumsum.py").read_text()
    alone = text.replace("pixel_values=pixel_values,\n                image_grid_thw=image_grid_thw, "
                         "mm_token_type_ids=mm_token_type_ids, ", "").replace(
        "ids = [*text_before, START, *[IMAGE] * n_image, END, *text_after]", "ids = [*text_before, *text_after]")
    assert alone != text
    (tmp_path / "alone.py").write_text(alone)
    status, found, report = traced(tmp_path, "alone", False, tmp_path)
    assert "flat-image-positions" not in {f["code"] for f in found}, report


def test_ms_swift_collator_left_the_training_forward_to_number_an_image_as_text(tmp_path):
    """modelscope/ms-swift#2051 (b8a8ec5a4; written blind, blind-rk, missed before the model's own positions were
    read): the Qwen2-VL template's collator handed the training forward no position_ids, and the model of that time
    (its get_rope_index ported from transformers 4.45) numbered them from the cache positions in t, h and w alike. The
    fix's collator hands get_rope_index's (3, B, L): quiet."""
    [hit] = check_bug(tmp_path, "ms_swift_qwen2vl_collator_no_rope_index_position_ids", "flat-image-positions", BLIND)
    assert "was handed no position_ids, and its Qwen2VLTextModel.forward rotated with (3, 2, 17)" in hit["message"]
    assert tuple(hit["cell"]) == (0, 3, 3) and "image tokens 3-6 (id 6) are at positions 3-6" in hit["message"], hit


def test_a_wrapper_that_calls_the_text_model_without_the_rope_index(tmp_path):
    """Written another way: a trainer's module splices the image features itself and calls Qwen2.5-VL's
    `language_model` with no position_ids, skipping the outer forward that makes the (t, h, w) index; the text model
    copies its cache positions into every section. --fixed hands get_rope_index's: quiet."""
    [hit] = check_bug(tmp_path, "vlm_wrapper_calls_language_model_without_rope_index", "flat-image-positions", FLATGRID)
    assert "VisionLanguageTrainer was handed no position_ids, and its Qwen2_5_VLTextModel.forward" in hit["message"]
    assert tuple(hit["cell"]) == (0, 3, 3) and "image tokens 3-8 (id 5) are at positions 3-8" in hit["message"], hit


def test_image_runs_against_a_loop():
    """flatgrid._image_runs: every run of two or more image ids, row by row, against a loop over every position."""
    import numpy as np

    from maskcli.checks.flatgrid import _image_runs

    def loop(ids, image):
        found = []
        for b in range(ids.shape[0]):
            j = 0
            while j < ids.shape[1]:
                end = j
                while ids[b, j] == image and end + 1 < ids.shape[1] and ids[b, end + 1] == image:
                    end += 1
                if end > j:
                    found.append((b, j, end))
                j = end + 1
        return found

    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, 3, size=(int(rng.integers(1, 4)), int(rng.integers(1, 9))))
        assert _image_runs(ids, 2) == loop(ids, 2), ids


def test_ms_swift_hunyuanvl_rope_rows_made_again_at_each_image(tmp_path):
    """modelscope/ms-swift 48fb0a9 (in #7038 before its merge; written blind, blind-zd; moved to tests/data/bugs):
    HunYuanVL's template made its four rope rows afresh for each image, so of a sample's two images the first was
    numbered as text in every row, handed as (4, B, L) ids. The fix (the rows made once) quiet."""
    [hit] = check_bug(tmp_path, "ms_swift_hunyuan_ocr_multi_image_xdrope_positions_reset_per_image", "flat-image-positions")
    assert "handed multimodal rope ids (4, 1, 34)" in " ".join(hit["message"].split())
    assert "image tokens 3-10 (id 120120) are at positions 3-10" in " ".join(hit["message"].split()), hit


def test_a_qwen25vl_collator_that_makes_the_rope_rows_again_at_each_image(tmp_path):
    """Written another way: a Qwen2.5-VL collator building the (3, B, L) ids itself, the rows started afresh at each
    image, so a sample's first image of two is laid as text (tokens 3-8). --fixed builds the rows once (get_rope_index's
    own ids on the real tokens): quiet, and so is the sample of one image either way."""
    [hit] = check_bug(tmp_path, "qwen25vl_rope_rows_made_again_at_each_image", "flat-image-positions", FLATGRID)
    assert tuple(hit["cell"]) == (0, 3, 3) and "multimodal rope ids (3, 2, 20)" in " ".join(hit["message"].split())
