"""checks/mediarows.py: text of a Flamingo-style media cross-attention that sees no latent, read uniformly anyway
(media-rows-uniform) or lost at a cached decode step (media-lost-at-decode)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug

MEDIAROWS = Path(__file__).parent / "data" / "mediarows"


def _before_media(ids: list[list[int]], media: int, pad: int | None = None) -> np.ndarray:
    """Bool (B, T) real text tokens before their row's first media token, by a loop over the ids."""
    found = np.zeros((len(ids), len(ids[0])), bool)
    for b, row in enumerate(ids):
        for t, token in enumerate(row):
            if token == media:
                break
            found[b, t] = token != pad
    return found


def test_flamingo_mini_text_before_first_image_attends_image(tmp_path):
    """dhansmair/flamingo-mini 196c64b: -max where masked, shifted by the row max, softmax: the text before the first
    <image> spread uniform weights over the image's latents (fix: alphas.masked_fill(text_time == 0, 0.))."""
    hits = check_bug(tmp_path, "flamingo_mini_text_before_first_image_attends_image", "media-rows-uniform")
    before = _before_media([[10, 11, 12, 3, 20, 21, 22, 23], [15, 3, 24, 25, 26, 27, 28, 29]], 3)
    b, q = np.argwhere(before)[0]
    assert tuple(hits[0]["cell"]) == (b, q, 0) and f"{int(before.sum())} such text tokens" in hits[0]["message"]


def test_openflamingo_style_text_before_image_weights_not_zeroed(tmp_path):
    """Written another way: lang_x beside media_token_id, a left-padded batch (its padding left out), torch.ge over
    every previous image, -1e9 with no shift; the fix multiplies the weights by (text_time > 0)."""
    hits = check_bug(tmp_path, "openflamingo_style_text_before_image_weights_not_zeroed", "media-rows-uniform",
                     folder=MEDIAROWS)
    ids = [[17, 23, 4, 31, 8, 9, 40], [0, 0, 4, 12, 19, 26, 33], [0, 44, 13, 4, 21, 7, 50]]
    before = _before_media(ids, 4, pad=0)
    b, q = np.argwhere(before)[0]
    assert tuple(hits[0]["cell"]) == (b, q, 0) and f"{int(before.sum())} such text tokens" in hits[0]["message"]


def test_open_flamingo_generate_cached_decode_loses_media_locations(tmp_path):
    """mlfoundations/open_flamingo 5c90779: each cached step's media_locations came from its new token alone, so
    text_time = 0 and its weights were zeroed; the 5-token prompt put <image> first in both rows."""
    hits = check_bug(tmp_path, "open_flamingo_generate_cached_decode_loses_media_locations", "media-lost-at-decode")
    prompt = 5
    assert tuple(hits[0]["cell"]) == (0, 0, 0)
    assert f"text token {prompt} of a cached decode step" in hits[0]["message"]
    assert "placed a media token at 0" in hits[0]["message"]


def test_interleaved_lm_decode_step_recomputes_media_from_new_token(tmp_path):
    """Written another way: a left-padded batch of two prompts with two images each, a (B * heads) bmm
    cross-attention, finfo.min and the rows zeroed after; the first decode step sits after the 7-token prompt."""
    hits = check_bug(tmp_path, "interleaved_lm_decode_step_recomputes_media_from_new_token", "media-lost-at-decode",
                     folder=MEDIAROWS)
    assert tuple(hits[0]["cell"]) == (0, 0, 0)
    assert "text token 7 of a cached decode step" in hits[0]["message"]
