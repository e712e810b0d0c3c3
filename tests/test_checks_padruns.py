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
