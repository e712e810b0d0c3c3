"""checks/jointtext.py: a joint (image + text) attention holding fewer text keys than a row's real text tokens."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

HERE = Path(__file__).parent / "data" / "jointtext"


def test_xdit_hunyuan_video_batch_uses_first_prompt_mask(tmp_path):
    """xdit-project/xDiT#546: the text tokens of the whole CFG batch selected with encoder_attention_mask[0]: 12 image
    tokens and 4 text keys, against prompts of 4 and 9 real tokens."""
    [hit] = check_bug(tmp_path, "xdit_hunyuan_video_batch_uses_first_prompt_mask", "joint-text-cut")
    assert "handed 12 tokens a row and attends 16: 4 text keys" in hit["message"]
    assert "states 9 real text tokens in row 1 ([4, 9] a row): 5 of row 1's prompt tokens" in hit["message"]


def test_text_first_trimmed_to_the_shortest_prompt(tmp_path):
    """Prompts of 7, 3 and 5 real tokens (padded to 8) trimmed to 3 for the batch, the text first, an explicit softmax
    with no mask: rows 0 and 2 lose 4 and 2 tokens."""
    [hit] = check_bug(tmp_path, "mmdit_text_trimmed_to_shortest", "joint-text-cut", HERE)
    assert "handed 6 tokens a row and attends 9: 3 text keys" in hit["message"]
    assert "states 7 real text tokens in row 0 ([7, 3, 5] a row)" in hit["message"]
