"""Text maps: a character over cells (or blocks) with anything visible is never drawn as empty."""

from __future__ import annotations

import re

import numpy as np
import pytest
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


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 10**7), st.integers(20, 300), st.integers(5, 100))
def test_a_mask_whose_rows_fit_gets_a_line_per_query(q_len, k_len, width, lines):
    blocks = choose_blocks(q_len, k_len, width, lines)
    assert (blocks.rows == 1) == (q_len <= lines)


def _map(expression, columns="80", **options):
    from typer.testing import CliRunner

    from maskcli.commands import app

    args = ["show", expression] + [part for flag, value in options.items() for part in (f"--{flag.replace('_', '-')}", str(value))]
    result = CliRunner().invoke(app, args, env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_a_decode_chunk_behind_a_long_cache_has_a_line_per_query_and_the_cache_edge():
    out = _map("window(4096)", offset=1000, len=16)
    rows = [line for line in out if line[:5].strip().isdigit() and "█" in line]
    assert [int(line.split()[0]) for line in rows] == list(range(1000, 1016))  # it was one line for all 16
    ruler = next(i for i, line in enumerate(out) if line.split()[:1] == ["0"])
    edge = out[ruler + 1]  # under the ruler: ║ over the column of key 1000, where the new keys start
    cols = 14  # 1016 keys in 73 characters
    start = len(rows[0]) - len(rows[0].split()[-1])
    assert edge.strip() == "║" and edge.index("║") == start + 1000 // cols
    assert "║ cached keys | new keys · underlined: the diagonal" in out


@pytest.mark.parametrize("columns", ["60", "120"])
def test_document_boundaries_are_on_the_ruler_and_beside_the_rows(columns):
    n, sizes = 1 << 20, [300_000, 400_000, 348_576]
    out = _map(f"document(sizes=[{','.join(map(str, sizes))}]) & window(4096)", columns)
    rows = [line for line in out if re.fullmatch(r"\s*\d+─? +[█▓░·]+", line)]
    per = int(rows[1].split()[0]) - int(rows[0].split()[0])  # queries a line
    start = len(rows[0]) - len(rows[0].split()[-1])
    found = re.search(r"one character = [\d,]+ queries x ([\d,]+) keys", " ".join(" ".join(out).split()))
    cols = int(found[1].replace(",", ""))
    boundaries = [300_000, 700_000]
    ruler = next(i for i, line in enumerate(out) if line.split()[:1] == ["0"])
    marks = [m.start() for m in re.finditer("│", out[ruler + 1])]
    assert marks == [start + b // cols for b in boundaries]
    marked = [int(line.split()[0].rstrip("─")) for line in rows if line.split()[0].endswith("─")]
    assert marked == [b // per * per for b in boundaries]  # the line whose block holds the first query of a document
    assert all(len(line) <= int(columns) for line in out)
    assert any(line.startswith("│ ─ doc boundaries") for line in out)
