"""shard's --html page: its embedded data against a double loop over positions and ranks (each rank's tokens by
hand, the mask by its own predicate), and the page in the system's chromium: the ring-step grid's pixels, the strip,
the table's text, hover, and names that would end its script."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.mask import build
from maskcli.render.html import BLOCK_TINTS
from maskcli.render.shardpage import shard_page
from maskcli.shard.plan import analyse
from test_render_html import box, browser, close, load, page_data, pixels, tab  # noqa: F401  (the browser fixtures)

EXPR, LENGTH, RANKS, HEAD_DIM = "document(sizes=[5,3,8]) & window(3)", 16, 2, 8


def keep(q: int, k: int) -> bool:
    """EXPR by hand: the same document, at most 2 keys back, never ahead."""
    doc = [0] * 5 + [1] * 3 + [2] * 8
    return doc[q] == doc[k] and 0 <= q - k < 3


def headtail_owner(length: int, ranks: int) -> list[int]:
    """Head-tail by hand: 2N chunks; rank r holds chunk r and chunk 2N-1-r."""
    chunk = length // (2 * ranks)
    return [min(p // chunk, 2 * ranks - 1 - p // chunk) for p in range(length)]


def expected():
    owner = headtail_owner(LENGTH, RANKS)
    grid = np.zeros((RANKS, RANKS), dtype=int)
    for q in range(LENGTH):
        for k in range(LENGTH):
            grid[owner[q], owner[k]] += keep(q, k)
    tokens = [owner.count(r) for r in range(RANKS)]
    steps = []
    for r in range(RANKS):
        row = []
        for i in range(RANKS):
            s = (r - i) % RANKS  # PyTorch's ring: step i brings rank (r - i) mod N's keys
            row.append("empty" if grid[r, s] == 0 else "full" if grid[r, s] == tokens[r] * tokens[s] else "partial")
        steps.append(row)
    return owner, tokens, grid, steps


def report(expr=EXPR, layout="headtail", length=LENGTH):
    return analyse([(expr, build(expr, length=length))], layout, RANKS, HEAD_DIM)


def test_the_pages_data_is_a_double_loop_over_positions_and_ranks():
    owner, tokens, grid, steps = expected()
    data = page_data(shard_page(report()))
    assert data["page"] == "shard" and data["layout"]["tokens"] == tokens
    mask = data["masks"][0]
    cells = grid.sum(axis=1)
    assert mask["cells"] == cells.tolist() and mask["grid"] == grid.tolist() and mask["steps"] == steps
    assert mask["flops"] == [4.0 * HEAD_DIM * c for c in cells]  # QK^T and PV: 2 FLOPs a multiply-add, each
    assert mask["ratio"] == pytest.approx((cells / cells.mean()).tolist())
    assert mask["imbalance"] == pytest.approx(cells.max() / cells.mean())
    # 16 positions: one span each, owned by the rank that holds it, no span with two changes of rank
    assert data["strip"]["owner"] == owner and not any(data["strip"]["mixed"])
    assert data["strip"]["edges"] == list(range(LENGTH + 1))


def test_the_ring_steps_and_the_strip_are_drawn_in_their_colours(tab):
    owner, tokens, grid, steps = expected()
    load(tab, shard_page(report()), "shard.html")
    shown = pixels(tab, "canvas.steps")
    size = shown.shape[0] // RANKS
    index = {"full": 0, "partial": 1, "empty": 2}  # BLOCK_TINTS' order: as blocks' page and terminal colour them
    for r in range(RANKS):
        for i in range(RANKS):
            assert close(shown[r * size + size // 2, i * size + size // 2], BLOCK_TINTS[index[steps[r][i]]]), (r, i)
    strip = pixels(tab, "#strip")
    middle = strip[strip.shape[0] // 2]
    at = [middle[int((p + 0.5) * middle.shape[0] / LENGTH)] for p in range(LENGTH)]
    for p in range(LENGTH):
        for other in range(LENGTH):
            assert close(at[p], at[other], 3) == (owner[p] == owner[other]), (p, other)


def test_the_table_and_hover_read_as_the_terminal(tab):
    owner, tokens, grid, steps = expected()
    load(tab, shard_page(report()), "table.html")
    rows = tab.evaluate("[...document.querySelectorAll('table.ranks tbody tr')].map((r) => [...r.cells].map((c) => c.textContent))")
    cells = grid.sum(axis=1)
    for r in range(RANKS):
        flops = 4 * HEAD_DIM * cells[r]
        skip = sum(s == "empty" for s in steps[r])
        assert rows[r][:6] == [str(r), str(tokens[r]), f"{cells[r]:,}", f"{flops / 1000:.3g}k" if flops >= 1000 else str(flops), f"{cells[r] / cells.mean():.3f}", f"{skip}/{RANKS}"]
    left, top, width, height = box(tab, "canvas.steps")
    tab.mouse.move(left + width * 0.75, top + height * 0.25)  # rank 0, step 1: the keys of rank 1
    assert tab.text_content(".step-cell") == f"rank 0, step 1: the keys of rank 1 · {steps[0][1]} · {grid[0, 1]} of {tokens[0] * tokens[1]} cells visible"
    left, top, width, _ = box(tab, "#strip")
    tab.mouse.move(left + width * (9.5 / LENGTH), top + 5)
    assert tab.text_content("#strip-cell") == f"position 9: rank {owner[9]}"
    assert tab.text_content("#findings") == "the ranks' parts add up to the global mask exactly"


def test_a_wrong_split_is_listed_in_red_and_names_in_the_file_run_nothing(tab, tmp_path):
    # an index file cut to 8 of 10 tokens, its name markup that would run or open a script were it read as HTML
    path = tmp_path / "<img src=x onerror=window.ran=1><!--<script>.json"
    path.write_text(json.dumps([[0, 1, 6, 7], [2, 3, 4, 5]]))
    load(tab, shard_page(analyse([("causal", build("causal", length=10))], str(path), 2, HEAD_DIM)), "cut.html")
    assert tab.evaluate("window.ran") is None and tab.evaluate("document.querySelectorAll('img, main script').length") == 0
    assert str(path) in tab.text_content(".sub")
    finding = tab.text_content("#findings li")
    assert finding.startswith("wrong: shard-dropped-token: 2 real tokens on no rank, the first at position 8")
    assert tab.evaluate("getComputedStyle(document.querySelector('#findings strong')).color") == "rgb(214, 39, 40)"


def test_html_writes_the_page_and_refuses_a_bad_path_with_no_file(tmp_path):
    out = tmp_path / "shard.html"
    result = CliRunner().invoke(app, ["shard", "causal", "--len", 16, "--ranks", 2, "--html", str(out)])
    assert result.exit_code == 0 and out.exists()
    assert page_data(out.read_text())["masks"][0]["cells"] == [sum(q + 1 for q in range(16) if min(q // 4, 3 - q // 4) == r) for r in range(2)]
    for bad in (tmp_path / "no" / "such.html", tmp_path / "shard.png"):
        result = CliRunner().invoke(app, ["shard", "causal", "--len", 16, "--ranks", 2, "--html", str(bad)])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and "--html" in result.output
        assert not bad.exists()
