"""checks/symmetric.py: a both-ways sliding window one key short on each side of W / 2, on a published bug written
blind (llama.cpp's converter, its config.json kept as JSON text) and a second program written another way (an
encoder's dataclass on self.config, a right-padded batch, an explicit softmax); each fix is quiet."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_llamacpp_converter_writes_the_adjusted_window(tmp_path):
    # ggml-org/llama.cpp#15867: the GGUF gets W // 2 + 1 = 4 for the config.json's 6, the runtime halves it again:
    # |q - k| <= 2, not the <= 3 of the stated 6 (read from the config.json text at the top of the program)
    flagged = check_bug(tmp_path, "llamacpp_convert_embeddinggemma_adjusted_sliding_window", "window-half-short")
    assert flagged[0]["source"].startswith("sliding_window=6 (CONFIG_JSON (JSON text) at the top of"), flagged
    assert "sees |q - k| <= 2, one key short on each side of the |q - k| <= 3" in flagged[0]["message"]


def test_an_encoder_band_built_with_a_strict_less_than(tmp_path):
    flagged = check_bug(tmp_path, "encoder_half_window_strict", "window-half-short", WINDOWS)
    assert flagged[0]["source"] == "sliding_window=8 (self.config of LocalEncoder (EncoderConfig))", flagged
    assert "sees |q - k| <= 3, one key short on each side of the |q - k| <= 4" in flagged[0]["message"]

