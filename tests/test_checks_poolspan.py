"""checks/poolspan.py (and trace/poolspan.py, which records what it reads): a causal module's pooled query, the mean of
a bucket of its keys' sequence shifted right, that sees the bucket's keys after every token it pooled; caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/poolspan), quiet on
the fixes; the shift read against a plain loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first

POOLSPAN = Path(__file__).parent / "data" / "poolspan"


def test_hourglass_pre_valley_resampling_attends_the_unshifted_bucket(tmp_path):
    """hourglass-transformer-pytorch d7dc1e0 (written blind): the pooled token of the sequence shifted by s - 1 = 3
    attends `x_residual`'s bucket of 4, unshifted; its fix attends the shifted `x`. 2 rows of 32 bytes: 16 buckets."""
    [hit] = check_bug(tmp_path, "hourglass_transformer_pytorch_pre_valley_resampling_attends_unshifted_tokens",
                      "pooled-query-sees-later")
    s, shift = 4, 3
    assert tuple(hit["cell"]) == first((16, 1, s), lambda b, q, k: k > s - 1 - shift)
    assert "shifted right by 3" in hit["message"] and f"({16 * shift} batch rows x keys;" in hit["message"]


def test_a_shortened_lm_resampling_windows_cut_from_the_unshifted_sequence(tmp_path):
    """Written another way: `torch.cat` shift by 2, `avg_pool1d`, windows of 3 cut by `unfold` (a copy), SDPA, 22 bytes
    padded to 24 (8 windows a row)."""
    [hit] = check_bug(tmp_path, "shortened_lm_resampling_attends_unshifted_window", "pooled-query-sees-later",
                      folder=POOLSPAN)
    s, shift = 3, 2
    assert tuple(hit["cell"]) == first((16, 1, s), lambda b, q, k: k > s - 1 - shift)
    assert "Resampler.causal" in hit["message"] and "shifted right by 2" in hit["message"]


def _pooled(sequence: np.ndarray, size: int, shift: int) -> np.ndarray:
    """The mean of each bucket of `size` of each row of `sequence` (B, L, D) shifted right by `shift`: a plain loop."""
    b, length, d = sequence.shape
    out = []
    for row in range(b):
        for start in range(0, length, size):
            total = np.zeros(d)
            for p in range(start, start + size):
                if p - shift >= 0:
                    total += sequence[row, p - shift]
            out.append(total / size)
    return np.array(out)


def test_the_shift_a_pooled_query_was_made_with_is_read_against_a_plain_loop():
    from maskcli.trace.poolspan import _shift

    rng = np.random.default_rng(0)
    sequence = rng.normal(size=(2, 12, 5))  # 2 rows of 3 buckets of 4
    buckets = sequence.reshape(6, 4, 5)
    for shift in range(4):
        query = _pooled(sequence, 4, shift)
        assert _shift(buckets, query, (2,)) == shift
        assert _shift(buckets, query, (1, 2, 3, 6)) == shift  # (a copy: every count of rows read)
    assert _shift(buckets, rng.normal(size=(6, 5)), (2,)) is None
