"""checks/cache.py: a static cache's unwritten slots, on a reproduction of a published bug."""

from __future__ import annotations

from checkbugs import check_bug


def test_static_cache_without_a_decode_mask(tmp_path):
    # onnxruntime/mobius#340, onnx/onnx#8068: a static cache's slots past input_pos hold no key yet
    check_bug(tmp_path, "static_cache_no_decode_mask", "unwritten-slot")
