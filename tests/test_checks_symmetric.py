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



def test_embeddinggemma_overlay_ored_onto_the_causal_window(tmp_path):
    # huggingface/transformers#40700: the sliding mask_mod `kv > q - 8` OR `|q - kv| <= 4` sees 7 keys back and 4
    # ahead, where the dataclass config on self.config states sliding_window=8 with use_bidirectional_attention
    flagged = check_bug(tmp_path, "transformers_embeddinggemma_bidirectional_window_too_wide", "window-lopsided")
    assert flagged[0]["source"].startswith("sliding_window=8 (self.config of Gemma3TextModel"), flagged
    assert "sees 7 keys behind each query and 4 ahead" in flagged[0]["message"]


def test_a_left_padded_encoder_causal_window_ored_with_the_band(tmp_path):
    # a dict config on self.cfg (sliding_window=6, is_causal=False), SDPA, row 0 left-padded by 3: read on the real
    # queries and keys only, 5 keys behind and 3 ahead (a double loop over positions: W - 1 = 5 behind, W // 2 = 3 ahead)
    flagged = check_bug(tmp_path, "encoder_causal_window_ored_with_band_left_padded", "window-lopsided", WINDOWS)
    behind = [sum(1 for k in range(q - 10, q) if k >= 0 and (q - k <= 3 or 0 <= q - k < 6)) for q in range(8, 14)]
    ahead = [sum(1 for k in range(q + 1, q + 10) if k - q <= 3) for q in range(5, 10)]
    assert set(behind) == {5} and set(ahead) == {3}
    assert "sees 5 keys behind each query and 3 ahead" in flagged[0]["message"], flagged
