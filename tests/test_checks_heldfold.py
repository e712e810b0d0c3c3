"""checks/heldfold.py: a held padding read over a call that folds its sequence into the batch in chunks of the keys,
against a double loop over positions."""

from __future__ import annotations

import numpy as np

from maskcli.checks.heldfold import chunked, padded_batch


def test_chunked_against_double_loop():
    real = np.zeros((3, 12), dtype=bool)
    for b, n in enumerate((12, 7, 2)):
        for j in range(12 - n, 12):  # left padding
            real[b, j] = True
    folded = chunked(real, 9, 4)
    for r in range(9):
        for k in range(4):
            assert folded[r, k] == real[r // 3, (r % 3) * 4 + k]
    assert chunked(real, 3, 12) is None  # (no fold: the keys are the sequence)
    assert chunked(real, 6, 4) is None  # (not as many rows as chunks)
    assert chunked(real, 6, 5) is None  # (12 positions are no whole number of chunks of 5)


def test_padded_batch():
    assert padded_batch(np.array([[1, 1, 1], [1, 1, 0]], dtype=bool), True)
    assert not padded_batch(np.array([[1, 1, 1], [0, 1, 1]], dtype=bool), True)  # (a plain `mask`: right only)
    assert padded_batch(np.array([[1, 1, 1], [0, 1, 1]], dtype=bool), False)
    assert not padded_batch(np.array([[1, 1, 1], [0, 0, 0]], dtype=bool), False)  # (a row with no real token)
    assert not padded_batch(np.array([[1, 0, 1], [1, 1, 1]], dtype=bool), False)  # (not one run at an edge)


def test_beyond_batch_reads_a_first_axis_folded_with_the_module_heads():
    """fairseq's MultiheadAttention lays `bsz * num_heads` rows on the first axis (heads axis 1): 4 rows of a module
    stating 4 heads are one sample, so lengths of a batch of 4 held by the program's main() (quiet-r146b: each utterance
    run alone after the batch) are not this call's; 16 rows are 4 samples, and a module stating no heads is read as
    its rows."""
    from types import SimpleNamespace

    from maskcli.checks.heldfold import beyond_batch

    lengths = {"kind": "lengths", "rows": np.array([12, 5, 9, 3])}
    alone = SimpleNamespace(shape=(4, 1, 1, 12), details={"own_heads": 4})
    assert beyond_batch(alone, lengths)
    assert not beyond_batch(SimpleNamespace(shape=(16, 1, 1, 12), details={"own_heads": 4}), lengths)
    assert not beyond_batch(SimpleNamespace(shape=(4, 1, 1, 12), details={}), lengths)
    assert not beyond_batch(SimpleNamespace(shape=(4, 4, 1, 12), details={"own_heads": 4}), lengths)  # (heads apart)
    assert not beyond_batch(alone, {"kind": "lengths", "rows": np.array([12])})
