"""checks/windowpaths.py: one config's sliding_window_size kept as W keys by one path and W + 1 by another."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

WINDOWS = Path(__file__).parent / "data" / "windows"
NAME = "litgpt_style_fused_and_eager_layers_count_window_apart"


def test_maxtext_splash_local_mask_one_extra_key(tmp_path):
    """AI-Hypercomputer/maxtext#4289: Splash's LocalMask given sliding_window_size as its inclusive left window keeps
    5 keys where the dense path over the same config keeps 4."""
    flagged = check_bug(tmp_path, "maxtext_splash_local_mask_window_one_extra_key", "window-off-by-one")
    assert "window(5)" in flagged[0]["message"] and flagged[0]["expected"] == "window(4)"


def test_module_config_fused_layer_one_key_wider_on_left_padded_batch(tmp_path):
    """Written another way: `self.config` of a LitGPT-style model, a left-padded batch, the fused layer's band built
    with triu(-W) (W + 1 keys: torch's own tril/triu count them) beside the eager layer's triu(-(W - 1))."""
    flagged = check_bug(tmp_path, NAME, "window-off-by-one", WINDOWS)
    wide = int(torch.ones(10, 10).tril().triu(diagonal=-3)[-1].sum())
    assert f"sees window({wide})" in flagged[0]["message"] and flagged[0]["expected"] == f"window({wide - 1})"
    assert "self.config of GPT (ModelArgs)" in flagged[0]["source"]


def test_one_path_alone_leaves_the_count_open(tmp_path):
    """Both layers fused: every path keeps W + 1, which is SGLang's reading of sliding_window_size: quiet."""
    source = (WINDOWS / f"{NAME}.py").read_text().replace("fused=i % 2 == 0", "fused=True")
    (tmp_path / f"{NAME}.py").write_text(source)
    status, found, report = traced(tmp_path, NAME, False, tmp_path)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
