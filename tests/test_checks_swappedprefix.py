"""checks/swappedprefix.py: two inputs the program holds laid end to end (their lengths), the later attended causal,
whose blocks between them are swapped, on the published bug's reproduction (tests/data/bugs) and a program written
another way (tests/data/swappedprefix), each quiet fixed; the reading against masks built by a double loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.swappedprefix import _swapped

SWAPPED = Path(__file__).parent / "data" / "swappedprefix"


def test_valle_text_and_audio_blocks_padded_with_the_other_values_are_found(tmp_path):
    """lifeiteng/vall-e c611592 (written blind, batch blind-cg): the AR stage's text rows padded with 'see', the audio
    rows with 'hide'; x_lens and y_lens held at the call. Fixed: the text rows hide the audio, the audio sees the text."""
    [hit, *_] = check_bug(tmp_path, "valle_ar_prefix_mask_pad_values_swapped", "prefix-blocks-swapped")
    assert "(x_lens: 7, 5 tokens from key 0, then y_lens: 9, 6 from key 7)" in hit["message"]
    assert hit["cell"] == [0, 0, 15]
    assert hit["source"] == "x_lens and y_lens held at the call"


def test_a_prompt_and_its_target_with_swapped_blocks_under_sdpa_are_found(tmp_path):
    """Written another way: a decoder-only speech LM, a text prompt and codec codes end to end, a bool mask built from
    blocks with torch.cat, SDPA, a padded batch of three. Fixed: the target sees the prompt, not the reverse."""
    [hit, *_] = check_bug(tmp_path, "prompt_target_decoder_sdpa_blocks_swapped", "prefix-blocks-swapped", SWAPPED)
    assert "(prompt_lens: 5, 3, 4 tokens from key 0, then target_lens: 6, 6, 4 from key 5)" in hit["message"]
    assert hit["cell"] == [0, 0, 10]


def _loop_mask(first, second, kind: str) -> np.ndarray:
    """(B, 1, L, L) built cell by cell: the first input's tokens at 0.., the second's from max(first); `kind` says how
    the two attend each other (prefix: the second sees the first; swapped: the first sees the second; apart: neither)."""
    p, length = max(first), max(first) + max(second)
    cells = np.zeros((len(first), 1, length, length), dtype=bool)
    for r in range(len(first)):
        for q in range(length):
            for k in range(length):
                q_first, k_first = q < p, k < p
                k_real = k < first[r] if k_first else k - p < second[r]
                if not k_real:
                    continue
                if q_first and k_first:
                    see = True
                elif not q_first and not k_first:
                    see = k <= q
                elif q_first:  # a first-input query, a second-input key
                    see = kind == "swapped"
                else:
                    see = kind == "prefix"
                cells[r, 0, q, k] = see
    return cells


def test_only_the_swapped_blocks_are_read_against_a_loop():
    for first, second in (([4, 2], [5, 3]), ([3, 3, 1], [2, 4, 4]), ([1], [2])):
        p = max(first)
        a, b = np.array(first), np.array(second)
        hits = _swapped(_loop_mask(first, second, "swapped"), a, b, p)
        assert hits is not None and hits[0][:2] == (0, 0)
        assert hits[0][2] == p + second[0] - 1  # the last real key of the second input
        assert _swapped(_loop_mask(first, second, "prefix"), a, b, p) is None
        assert _swapped(_loop_mask(first, second, "apart"), a, b, p) is None
    both_ways = _loop_mask([3, 2], [4, 4], "swapped")
    both_ways[:, :, 3:, 3:] = True  # the second input not causal among itself: nothing said
    assert _swapped(both_ways, np.array([3, 2]), np.array([4, 4]), 3) is None
