"""checks/imageruns.py (and trace/tops.py's image_token_mask): an image token that sees a later image's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, traced

HERE = Path(__file__).parent / "data" / "items"


def test_trtllm_gemma3_flashinfer_mask_one_type_for_every_image(tmp_path):
    """NVIDIA/TensorRT-LLM#5976: every image token typed 1; two requests packed, one call per request."""
    pytest.importorskip("transformers")  # (its config classes: the hf extra)
    [hit] = check_bug(tmp_path, "trtllm_gemma3_flashinfer_mask_image_tokens_attend_other_images", "image-sees-later-image")
    assert hit["message"].startswith("query 2 (image 0 of the request at token 0) sees later key 6 of image 1")
    assert "one span per image as gemma3_text does" in hit["message"]


def test_image_mask_anded_with_itself_written_another_way(tmp_path):
    """One row, one call per layer, `image_mask` by keyword: image_mask[q] & image_mask[k]."""
    pytest.importorskip("transformers")  # (its config classes: the hf extra)
    [hit] = check_bug(tmp_path, "gemma3_image_mask_one_call", "image-sees-later-image", HERE)
    assert hit["message"].startswith("query 2 (image 0 of the request at token 0) sees later key 7 of image 1")


def test_all_images_one_span_under_no_family_is_only_suspicious(tmp_path):
    """The same mask where no config names Gemma 3: a model may attend all its images as one span (Molmo2)."""
    pytest.importorskip("transformers")  # (its config classes: the hf extra)
    status, found, report = traced(tmp_path, "gemma3_image_mask_one_call", False, HERE, ("--all-images-one-span",))
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    [hit] = [f for f in found if f["code"] == "image-sees-later-image"]
    assert hit["severity"] == "suspicious" and "unless the model attends all its images as one span" in hit["message"]
