"""checks/padruns.py: the run of pad ids ending each row, past its first token (an EOS that pads), against a loop;
the rule it serves (padding-unmarked) is tested on its programs in tests/test_checks_tokens.py."""

from __future__ import annotations

import numpy as np

from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli.checks.padruns import bounded_inside, tails


def test_the_pad_run_past_its_first_token():
    at_pad = np.array([[0, 0, 1, 1, 1], [1, 0, 0, 1, 1], [0, 0, 0, 0, 1], [0, 1, 0, 0, 0]], bool)
    expected = np.zeros_like(at_pad)
    for b in range(at_pad.shape[0]):
        k = at_pad.shape[1] - 1
        while k >= 0 and at_pad[b, k]:
            k -= 1
        for j in range(k + 2, at_pad.shape[1]):  # (k + 1: the run's first token)
            expected[b, j] = True
    assert (tails(at_pad) == expected).all()


def test_bert_nli_batch_mask_padded_with_ones(tmp_path):
    """yg211/bert_nli#3 (written blind, batch blind-mp; caught before any rule changed for it): build_batch padded each
    shorter pair's attention_mask with 1s, so real tokens attended the [PAD] positions. The fix pads it with 0s."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "bert_nli_build_batch_attention_mask_padded_with_ones", "padding-unmarked")[0]
    assert "a token at the model's pad id (0)" in " ".join(hit["message"].split())


def _reference_bounded(at_pad: np.ndarray, mask: np.ndarray) -> bool:
    """By a loop: each row with a pad-id token marked 1 has 0s, all of them pad ids, one run touching an edge; and the
    rows holding a pad id keep different numbers of them marked 1."""
    kept = []
    for b in range(at_pad.shape[0]):
        if not at_pad[b].any():
            continue
        count = sum(1 for j in range(at_pad.shape[1]) if at_pad[b, j] and mask[b, j] == 1)
        kept.append(count)
        if not count:
            continue
        zeros = [j for j in range(at_pad.shape[1]) if mask[b, j] == 0]
        if not zeros or any(not at_pad[b, j] for j in zeros):
            return False
        if zeros != list(range(zeros[0], zeros[0] + len(zeros))) or (zeros[0] != 0 and zeros[-1] != at_pad.shape[1] - 1):
            return False
    return len(set(kept)) > 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=6, max_size=6), min_size=1, max_size=3))
def test_bounded_inside_against_a_loop(rows):
    at_pad = np.array([[p for p, _ in row] for row in rows], bool)
    mask = np.array([[int(m) for _, m in row] for row in rows])
    assert bounded_inside(at_pad, mask) == _reference_bounded(at_pad, mask)


def test_a_block_kept_real_over_its_first_pads_is_bounded_inside():
    """xlm-core#48's fix: row 0's pad run 8..13, the mask's padding 9..13 (pad 8 kept in the block); row 1's pad 13
    masked. An all-ones mask, a mask padded on the other side, and one pad kept in every row (Chroma's) are not."""
    at_pad = np.zeros((2, 14), bool)
    at_pad[0, 8:], at_pad[1, 12:] = True, True
    mask = np.ones((2, 14), int)
    mask[0, 9:], mask[1, 12:] = 0, 0
    assert bounded_inside(at_pad, mask)
    assert not bounded_inside(at_pad, np.ones((2, 14), int))
    other = np.ones((2, 14), int)
    other[0, :2] = 0
    assert not bounded_inside(at_pad, other)
    plus_one = np.ones((2, 14), int)
    plus_one[0, 9:], plus_one[1, 13:] = 0, 0
    assert not bounded_inside(at_pad, plus_one)
