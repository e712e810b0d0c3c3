"""Text maps: a character over cells (or blocks) with anything visible is never drawn as empty."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from maskcli.blockmask import EMPTY, FULL, PARTIAL
from maskcli.render.blocks import symbols
from maskcli.render.density import Blocks, choose_blocks, density_text, shade


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 6)), elements=st.sampled_from([0.0, 1e-12, 0.3, 0.5, 0.51, 0.999, 1.0])))
def test_shade_never_hides_a_visible_cell(shares):
    chars = shade(shares)
    assert ((chars == "·") == (shares == 0)).all()
    assert ((chars == "█") == (shares == 1)).all()


@settings(max_examples=200, deadline=None)
@given(arrays(np.int8, st.tuples(st.integers(1, 12), st.integers(1, 12)), elements=st.sampled_from([EMPTY, PARTIAL, FULL])),
       st.integers(1, 4), st.integers(1, 4))
def test_block_symbols_say_what_the_blocks_under_them_are(categories, rows, cols):
    chars = symbols(categories, rows, cols)
    for i in range(chars.shape[0]):
        for j in range(chars.shape[1]):
            under = set(categories[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].ravel().tolist())
            expected = "▒" if PARTIAL in under else "▓" if under == {FULL, EMPTY} else "█" if under == {FULL} else "·"
            assert chars[i, j] == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**9), st.integers(10, 300), st.integers(5, 100))
def test_maps_fit_the_width_and_the_lines(q_len, k_len, width, lines):
    blocks = choose_blocks(q_len, k_len, width, lines)
    assert -(-k_len // blocks.cols) <= width
    assert -(-q_len // blocks.rows) <= lines


def test_the_legend_names_the_block_size_and_how_it_was_counted():
    text = density_text(np.array([[1.0, 0.2]]), Blocks(20972, 20972), 20972, 41944, how="exact, from key intervals").plain
    assert "one character = 20,972 queries x 20,972 keys (exact, from key intervals)" in text
    assert text.splitlines()[1].split() == ["0", "█░"]
