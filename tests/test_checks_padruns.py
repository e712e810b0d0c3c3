"""checks/padruns.py: the run of pad ids ending each row, past its first token (an EOS that pads), against a loop;
the rule it serves (padding-unmarked) is tested on its programs in tests/test_checks_tokens.py."""

from __future__ import annotations

import numpy as np

from maskcli.checks.padruns import tails


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
