"""Exact counts per block, from intervals and cell by cell, against sums of the dense cells."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.counting import block_counts, block_shares, edges, how_counted
from maskcli.mask import build, from_tensor


def dense_counts(cells, q_edges, k_edges, k_start=0):
    return np.array([
        [cells[q_edges[i] : q_edges[i + 1], k_edges[j] - k_start : k_edges[j + 1] - k_start].sum() for j in range(len(k_edges) - 1)]
        for i in range(len(q_edges) - 1)
    ])


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("causal", {"length": 37}),
        ("window(5) | sink(3)", {"length": 41, "offset": 7}),
        ("document(sizes=[9,20,11]) & ~window(3)", {}),
        ("chunk(" + ",".join(str(v) for v in [0, 1, 0, 2, 1, 3] * 6) + ")", {}),  # labels go down: cell by cell
        ("causal", {"length": 13, "kv_start": 4}),
    ],
)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (4, 3), (7, 16), (64, 64)])
def test_block_counts_are_exact(text, options, rows, cols):
    built = build(text, **options)
    f = built.frame
    q_edges, k_edges = edges(f.q_len, rows), edges(f.k_len, cols, f.k_start)
    counts = block_counts(built, 0, 0, rows, cols)
    assert np.array_equal(counts, dense_counts(built.dense()[0, 0], q_edges, k_edges, f.k_start))
    shares = block_shares(built, 0, 0, rows, cols)
    assert ((shares > 0) == (counts > 0)).all() and shares.max() <= 1


def test_edges_cover_the_axis_with_a_short_last_block():
    assert edges(10, 4).tolist() == [0, 4, 8, 10]
    assert edges(8, 4, start=3).tolist() == [3, 7, 11]
    assert edges(3, 5).tolist() == [0, 3]


def test_how_counted_says_which_path():
    assert how_counted(build("causal")) == "exact, from key intervals"
    assert "cell by cell" in how_counted(build("chunk(1,0)"))
    tensor = from_tensor(np.tril(np.ones((1, 1, 4, 4), dtype=bool)), "file.pt")
    assert "cell by cell" in how_counted(tensor)
    assert np.array_equal(block_counts(tensor, 0, 0, 2, 2), [[3, 0], [4, 3]])


def test_a_million_token_window_band_is_never_drawn_empty():
    built = build("window(128)", length=1 << 20)
    shares = block_shares(built, 0, 0, 1 << 15, 1 << 14)  # a 32 x 64 map
    diagonal = [shares[i, 2 * i] for i in range(32)]
    assert all(share > 0 for share in diagonal)
    assert shares[5, 20] == 0
