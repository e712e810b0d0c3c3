"""checks/flipped.py: a cached token the model call calls real, then padding (hidden), then real again."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug

BLIND = Path(__file__).parent / "data" / "blind"
FLIPPED = Path(__file__).parent / "data" / "flipped"


def test_llava_next_cached_decode_pads_marked_in_the_appended_columns(tmp_path):
    """transformers#29850 (written blind, batch blind-pb; missed before tuning): LLaVA-NeXT rebuilt each cached step's
    mask from the text mask with the image's missing columns appended after it and the pads marked among those, so the
    left-padded row (4 pads) hides 4 real prompt keys at decode step 1, and one of them is seen again at step 2 as the
    text mask grows by a column. The fix (the whole past rebuilt, the pads zeroed where they are) is quiet."""
    [hit] = check_bug(tmp_path, "transformers_llava_next_cached_decode_pad_columns_zeroed_in_image_span",
                      "padding-flipped", BLIND)
    assert hit["message"].startswith("batch row 1: key 13, a cached token the row's queries saw at step 0, is called "
                                     "padding by the model call's attention_mask")
    assert "hidden at step 1 (keys 13-16 there), then called real and seen again at step 2" in hit["message"]
    assert hit["cell"] == [1, 28, 13]  # (the first decode step's query sits at column 28, after the 28 prompt keys)


def _buggy_key_masks(text: list[int], image: int, steps: int) -> list[list[int]]:
    """The loop's masks over the cache at each cached step of the program written another way, by hand: the text mask
    grown by a 1 a step, then its first `image` columns appended after it."""
    found, mask = [], list(text)
    for _ in range(steps):
        mask = mask + [1]
        found.append(mask + mask[:image])
    return found


def test_image_columns_padding_copied_after_the_growing_text_mask(tmp_path):
    """Written another way: a hand-written decoder with 4 image tokens before a left-padded text prompt, whose loop
    hands each cached step a key mask made from the text mask, its first 4 columns appended after it: row 1's zeros
    land on its cached real tokens, one column further on at every step."""
    [hit] = check_bug(tmp_path, "image_columns_padding_copied_after_growing_text_mask", "padding-flipped", FLIPPED)
    image, text = 4, [0, 0, 1, 1, 1, 1]
    prompt = [1] * image + text  # the keys the prefill's real queries of row 1 see: the image and the real text
    masks = _buggy_key_masks(text, image, 2)
    first = next(k for k in range(len(prompt)) if prompt[k] and not masks[0][k] and masks[1][k])
    hidden = [k for k in range(len(prompt) + 1) if k < len(prompt) and prompt[k] and not masks[0][k]]
    assert f"batch row 1: key {first}, a cached token" in hit["message"]
    assert f"hidden at step 1 (keys {hidden[0]}-{hidden[1]}, {hidden[2]}-{hidden[3]} there)" in hit["message"]


def test_a_key_evicted_by_its_mask_for_good_is_no_flip():
    """A cache that evicts by masking (a sliding window over a model call's attention_mask) hides a key and never sees
    it again: REAL -> HIDDEN, never AGAIN."""
    from types import SimpleNamespace

    from maskcli.checks.flipped import HIDDEN, REAL, _advance, _begin

    keys = 6
    seen = np.ones((1, keys), bool)
    state = _begin(np.ones((1, keys), bool), seen, np.arange(keys), SimpleNamespace(step=0))
    for step, dropped in ((1, 1), (2, 2), (3, 3)):
        width = keys + step
        real = np.ones((1, width), bool)
        real[0, :dropped] = False  # (the oldest keys called padding once they leave the window, and left so)
        hit = _advance(state, real, real.copy(), np.ones((1, 1), bool), np.array([width - 1]),
                       SimpleNamespace(step=step), "attention_mask")
        assert hit is None
    assert state["marks"][0, :3].tolist() == [HIDDEN] * 3 and state["marks"][0, 3] == REAL
