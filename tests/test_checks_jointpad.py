"""checks/jointpad.py: a joint (image + text) attention whose image queries see the prompt padding its text mask
states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, first
from maskcli.checks.jointpad import _padding, _seen

HERE = Path(__file__).parent / "data" / "jointpad"


def _first_seen(lengths: list[int], width: int, n: int, start: int, left: bool = False):
    """The first (row, image query, padded prompt key) an unmasked joint attention over n image tokens and a prompt of
    `width` tokens at keys start .. start + width - 1 shows, by a double loop over absolute positions."""
    def padded(b, k):
        at = k - start
        real = at >= width - lengths[b] if left else at < lengths[b]
        return 0 <= at < width and not real

    image = lambda q: not start <= q < start + width  # noqa: E731
    return first((len(lengths), n + width, n + width), lambda b, q, k: image(q) and padded(b, k))


@pytest.mark.parametrize("name, lengths, width, n, folder", [
    # huggingface/diffusers#10033 (128b96f): Mochi's processor joined all 12 T5 tokens to the 16 video tokens, no mask
    ("diffusers_mochi_joint_attention_attends_padded_prompt_tokens", [5, 9], 12, 16, None),
    # chengzeyi/ParaAttention#26 (8effb91): the first-block cache ran HunyuanVideo's blocks with attention_mask=None
    ("paraattention_hunyuan_video_fbcache_drops_text_padding_mask", [4, 8], 10, 12, None),
    # the same bug written another way: a TeaCache-style adapter, nn.MultiheadAttention's key_padding_mask dropped
    ("teacache_adapter_mha_joint_drops_key_padding", [6, 10, 3], 10, 10, HERE),
])
def test_a_joint_attention_handed_no_mask_sees_the_prompt_padding(tmp_path, name, lengths, width, n, folder):
    """Text after the image tokens or before them, the unmasked joint attention shows the padding either way: the cell
    said is the first of the text-after reading, and the one of the text-before reading is said too."""
    [hit] = check_bug(tmp_path, name, "joint-padding-seen", *((folder,) if folder else ()))
    after, before = _first_seen(lengths, width, n, n), _first_seen(lengths, width, n, 0)
    assert hit["cell"] == list(after)
    assert f"image query {after[1]} of batch row {after[0]} sees padded prompt key {after[2]}; before them, image " \
           f"query {before[1]} of batch row {before[0]} sees padded prompt key {before[2]}" in hit["message"]
    assert f"calls {[width - x for x in lengths]} of them padding a row" in hit["message"]


def test_a_left_padded_prompt_first_whose_mask_the_block_never_builds(tmp_path):
    """The Mochi bug written another way: an SD3-style block, the prompt first, left-padded (5, 8 and 3 of 8), an
    explicit softmax; the fix's [prompt mask, ones] fill is quiet."""
    [hit] = check_bug(tmp_path, "sd3_joint_softmax_ignores_prompt_mask", "joint-padding-seen", HERE)
    before = _first_seen([5, 8, 3], 8, 9, 0, left=True)
    assert f"image query {before[1]} of batch row {before[0]} sees padded prompt key {before[2]}" in hit["message"]


@pytest.mark.parametrize("name, lengths, width, start, folder", [
    # kohya-ss/sd-scripts 2e89cd2c: Flux.forward called every SingleStreamBlock without txt_attention_mask
    ("sd_scripts_flux_single_blocks_drop_t5_attn_mask", [5, 9], 12, 0, None),
    # the same bug written another way: the video first, an additive finfo.min bias the single blocks never get
    ("hunyuan_single_stream_blocks_drop_prompt_bias", [7, 2], 8, 12, HERE),
])
def test_single_stream_blocks_handed_no_mask_beside_masked_joint_ones(tmp_path, name, lengths, width, start, folder):
    """The dual-stream blocks keep to the prompt's padding (quiet); the single-stream blocks over the same joined
    tokens do not: a single-stream block is said."""
    [hit] = check_bug(tmp_path, name, "joint-padding-seen", *((folder,) if folder else ()))
    assert "single_blocks.0" in hit["message"]
    length = [int(x) for x in hit["message"].split(" attends ")[1].split(" tokens")[:1]][0]
    n = length - width
    found = _first_seen(lengths, width, n, start)
    assert hit["cell"] == list(found)


def test_what_is_read_as_a_prompts_padding():
    """Right- or left-padded rows with a real token each, one row padded at least; not a loss mask in the middle, not a
    batch with no padding, not an empty prompt."""
    assert _padding(np.array([[1, 1, 0], [1, 1, 1]])) is not None
    assert _padding(np.array([[0, 1, 1], [0, 0, 1]])) is not None
    assert _padding(np.array([[1, 0, 1], [1, 1, 1]])) is None
    assert _padding(np.array([[1, 1, 1], [1, 1, 1]])) is None
    assert _padding(np.array([[0, 0, 0], [1, 1, 1]])) is None
    assert _padding(np.array([[2, 1, 0], [1, 1, 1]])) is None


def test_seen_cells_against_a_loop():
    """_seen against a triple loop: the image queries (outside the prompt's keys) that see a key its row pads."""
    rng = np.random.default_rng(0)
    cells = rng.random((2, 7, 7)) < 0.6
    real = np.array([[True, True, False], [True, False, False]])
    for start in (0, 4):
        seen = _seen(cells, real, start)
        for b in range(2):
            for q in range(7):
                for k in range(7):
                    want = cells[b, q, k] and not start <= q < start + 3 and start <= k < start + 3 \
                        and not real[b, k - start]
                    assert seen[b, q, k] == want
