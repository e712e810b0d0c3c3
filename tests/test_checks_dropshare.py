"""checks/dropshare.py: a sequence dropout that keeps the same key slots in every row, counted over padding
(dropout-keeps-padding-share), caught in the published bug's reproduction (tests/data/bugs) and in a program written
another way (tests/data/dropshare), quiet on the fixes and on a Linformer's projected keys; the flagged cell against a
plain loop over the rows' kept keys and the stated share."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced
from maskcli.checks.dropshare import kept_rows

DROPSHARE = Path(__file__).parent / "data" / "dropshare"


def _over(lengths: list[int], width: int, slots: int, keep: float):
    """(b, 0, k): the first padded row's key slot past its share, where a row keeps min(slots, its length) real tokens
    as the first keys of its slots (the buggy dropout: real tokens ranked first, then padding)."""
    def bad(b, q, k):
        kept = min(slots, lengths[b])
        return lengths[b] < width and q == 0 and k < kept and k >= math.ceil(lengths[b] * keep)
    return first((len(lengths), 1, slots), bad)


def test_perceiver_io_dropout_seq_keeps_every_real_token_of_a_short_row(tmp_path):
    # lucidrains/perceiver-pytorch c8c5f57: dropout_seq kept int((1 - p) * n) slots of every row, padding ranked last
    found = check_bug(tmp_path, "perceiver_pytorch_perceiver_io_dropout_seq_padded_sequence_keeps_all_tokens",
                      "dropout-keeps-padding-share")
    assert tuple(found[0]["cell"]) == _over([24, 6], 24, 12, 0.5)
    assert "keeps 6 of its 6 real tokens" in found[0]["message"] and "seq_dropout_prob=0.5" in found[0]["message"]


def test_a_resampler_token_drop_over_a_left_padded_batch_is_found(tmp_path):
    # written another way: a dataclass config's token_drop, left padding, nn.MultiheadAttention's key_padding_mask
    found = check_bug(tmp_path, "resampler_token_drop_fixed_slots_left_padded", "dropout-keeps-padding-share",
                      folder=DROPSHARE)
    assert tuple(found[0]["cell"]) == _over([16, 5, 10], 16, 12, 0.75)
    assert "self.cfg.token_drop=0.25" in found[0]["message"] and "2 such batch rows" in found[0]["message"]


def test_a_linformer_whose_keys_are_the_share_of_its_positions_is_quiet(tmp_path):
    status, found, report = traced(tmp_path, "quiet_linformer_projected_keys_with_dropout", False, DROPSHARE)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def _loop(seen: np.ndarray, real: np.ndarray, keep: float):
    fair, over = [], []
    for b in range(seen.shape[0]):
        length = sum(bool(x) for x in real[b])
        kept = sum(bool(x) for x in seen[b])
        low, high = max(1, math.floor(length * keep + 1e-9)), max(1, math.ceil(length * keep - 1e-9))
        if length and low <= kept <= high:
            fair.append(b)
        elif length and high < kept <= length < real.shape[1]:
            over.append((b, kept, high))
    return fair, over


def test_the_rows_read_match_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, n = int(rng.integers(1, 5)), int(rng.integers(2, 20))
        slots = int(rng.integers(1, n + 1))
        keep = float(rng.choice([0.25, 0.5, 0.75, 0.9]))
        lengths = rng.integers(1, n + 1, rows)
        real = np.arange(n)[None, :] < lengths[:, None]
        seen = np.arange(slots)[None, :] < rng.integers(0, slots + 1, rows)[:, None]
        assert kept_rows(seen, real, keep) == _loop(seen, real, keep)
