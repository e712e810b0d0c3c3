"""The --html pages in a real browser: the system's chromium, driven by Playwright (never a downloaded browser).

Pages are loaded from files; the mouse moves through the DevTools protocol; the text shown on hover and the pixels
drawn (a screenshot read back with matplotlib.image) are checked against masks computed here by double loops over
absolute positions (tests/definitions.py) and against `maskcli show --why` for the same cell. One browser serves the
module. Timings are not asserted here (benchmarks/page.py measures them).
"""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import definitions as ref
from maskcli.mask import MaskOptions, build, from_tensor
from maskcli.render import html, pagedata
from maskcli.render.heatmaps import LEAK_RGB, MASKED_RGB, VISIBLE_RGB
from maskcli.render.diff import ONLY_B_RGB
from maskcli.render.why import diff_why_text, why_text
from maskcli.why import explain
from strategies import cases, expected_cells

# MASKCLI_CHROMIUM names the browser (a path that does not exist skips the tests); else the system's chromium
CANDIDATES = [os.environ["MASKCLI_CHROMIUM"]] if "MASKCLI_CHROMIUM" in os.environ else [
    shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser"), shutil.which("google-chrome")]
CHROMIUM = next((path for path in CANDIDATES if path and os.path.exists(path)), None)
VIEWPORT = {"width": 1000, "height": 700}  # a laptop's browser window: the page must fit it


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium found (apt-get install chromium, or set MASKCLI_CHROMIUM): the browser tests need one")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def tab(browser, tmp_path_factory):
    """One tab for the module, with every request it makes recorded."""
    page = browser.new_page(viewport=VIEWPORT)
    page.requests, page.errors = [], []
    page.on("request", lambda request: page.requests.append(request.url))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.folder = tmp_path_factory.mktemp("pages")
    yield page
    page.close()


def load(tab, text: str, name: str = "page.html", scheme: str = "light"):
    path = tab.folder / name
    path.write_text(text, encoding="utf-8")
    tab.emulate_media(color_scheme=scheme)
    tab.requests.clear()
    tab.goto(path.as_uri())
    tab.wait_for_function("window.__maskcliFirstDraw !== undefined")
    assert tab.errors == []
    assert tab.requests == [path.as_uri()]  # the page itself, and nothing from the network
    tab.size = size(tab)
    return path


def box(tab, selector="#mask"):
    """The canvas's drawing area on the screen: left, top, width, height."""
    return tab.evaluate("(s) => { const c = document.querySelector(s), r = c.getBoundingClientRect();"
                        " return [r.left + c.clientLeft, r.top + c.clientTop, c.width, c.height]; }", selector)


def pixels(tab, selector="#mask") -> np.ndarray:
    """The canvas as the screen shows it: (H, W, 3) ints 0-255, from a screenshot read back by matplotlib."""
    import matplotlib.image as mpimg

    left, top, width, height = box(tab, selector)
    shot = tab.screenshot(clip={"x": left, "y": top, "width": width, "height": height})
    return np.round(mpimg.imread(io.BytesIO(shot), format="png")[..., :3] * 255).astype(int)


def hover(tab, x: float, y: float, selector="#mask"):
    left, top, _, _ = box(tab, selector)
    tab.mouse.move(left + x, top + y)
    return tab.inner_text("#cell"), tab.text_content("#why")


def size(tab) -> tuple[int, int]:
    """The canvas's width and height in pixels (the page sizes it to the window); None on a page without it (shard's)."""
    found = tab.evaluate("(() => { const c = document.getElementById('mask'); return c && [c.width, c.height]; })()")
    return tuple(found) if found else None


def cell_centre(tab, q_local: int, kv_local: int, lq: int, lk: int) -> tuple[float, float]:
    width, height = tab.size
    return (kv_local + 0.5) * width / lk, (q_local + 0.5) * height / lq


def close(found, want, tolerance=2) -> bool:
    return bool(np.all(np.abs(np.asarray(found) - np.asarray(want)) <= tolerance))


def reference(tree, lq, q0=0, k0=0, lk=None):
    return np.array(ref.dense(tree, q0=q0, lq=lq, k0=k0, lk=lk or lq)[0])


DOC_WINDOW = ("and", [("kind", "document", {"labels": [[0] * 5 + [1] * 4 + [2] * 3]}), ("kind", "window", {"window": 3})])
CAUSAL_BLOCKS = ("or", [("kind", "causal", {}), ("kind", "blocks", {"labels": [[-1, -1, 0, 0, 0, -1, 1, 1, -1, -1]]})])
SINKS = ("and", [("kind", "causal", {}), ("or", [("kind", "window", {"window": 3}), ("kind", "sink", {"sink": 2})])])


@pytest.mark.parametrize("tree, lq", [(DOC_WINDOW, 12), (CAUSAL_BLOCKS, 10), (SINKS, 16)])
def test_every_cell_is_drawn_in_the_colour_of_the_definition(tab, tree, lq):
    load(tab, html.mask_page(build(ref.text(tree), MaskOptions(length=lq))))
    shown, want = pixels(tab), reference(tree, lq)
    for q in range(lq):
        for kv in range(lq):
            x, y = cell_centre(tab, q, kv, lq, lq)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if want[q, kv] else MASKED_RGB), (q, kv, shown[int(y), int(x)])


def test_a_cache_offset_places_the_cells_and_marks_the_cache_edge(tab):
    mask = build("window(3)", MaskOptions(length=4, offset=4))  # queries 4-7, keys 0-7
    load(tab, html.mask_page(mask))
    shown = pixels(tab)
    want = np.array(ref.dense(("kind", "window", {"window": 3}), q0=4, lq=4, k0=0, lk=8)[0])
    for q in range(4):
        for kv in range(8):
            x, y = cell_centre(tab, q, kv, 4, 8)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if want[q, kv] else MASKED_RGB), (q, kv)
    width = tab.size[0]
    edge = shown[2, width // 2 - 1 : width // 2 + 1]  # key 4 starts mid-canvas: the cache line, orange (its first dash)
    assert any(close(pixel, (217, 115, 0), 12) for pixel in edge), edge
    cell, why = hover(tab, *cell_centre(tab, 1, 2, 4, 8))
    assert cell.splitlines()[0] == "q 5 · kv 2 · q_idx 1 · kv_idx 2" and cell.splitlines()[-1] == "masked"
    assert why == why_text(mask, [explain(mask, 0, 5, 2)])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(cases(), st.data())
def test_hover_shows_the_cell_and_the_same_why_as_the_command_line(tab, case, data):
    tree, options, frame, valid = case
    mask = build(ref.text(tree), MaskOptions(**options))
    expected = expected_cells(tree, options, frame, valid, mask.batch)
    q0, lq, k0, lk = frame
    load(tab, html.mask_page(mask))
    b = data.draw(st.integers(0, mask.batch - 1))
    if mask.batch > 1:
        tab.select_option("#batch", str(b))
    q, kv = data.draw(st.integers(q0, q0 + lq - 1)), data.draw(st.integers(k0, k0 + lk - 1))
    cell, why = hover(tab, *cell_centre(tab, q - q0, kv - k0, lq, lk))
    first = cell.splitlines()[0]
    assert first.startswith(f"q {q} · kv {kv}") and (f"batch row {b}" in first) == (mask.batch > 1)
    assert cell.splitlines()[-1] == ("kept" if expected[b, q - q0, kv - k0] else "masked")
    assert why == why_text(mask, [explain(mask, b, q, kv)])
    shown = pixels(tab)
    x, y = cell_centre(tab, q - q0, kv - k0, lq, lk)
    if not valid or (all(_valid_at(valid, b, kv) for kv in range(k0, k0 + lk)) and _valid_at(valid, b, q)):  # no hatching there
        assert close(shown[int(y), int(x)], VISIBLE_RGB if expected[b, q - q0, kv - k0] else MASKED_RGB)


def _valid_at(valid, b, position):
    row = valid[b] if len(valid) > 1 else valid[0]
    return position >= len(row) or row[position]


def test_diff_page_colours_and_names_each_category(tab):
    a_tree, b_tree, n = ("kind", "document", {"labels": [[0, 0, 0, 1, 1, 1, 1, 2]]}), ("kind", "window", {"window": 3}), 8
    a, b = build(ref.text(a_tree), MaskOptions(length=n)), build(ref.text(b_tree), MaskOptions(length=n))
    load(tab, html.diff_page(a, b))
    in_a, in_b = reference(a_tree, n), reference(b_tree, n)
    shown = pixels(tab)
    colours = {(True, True): VISIBLE_RGB, (True, False): LEAK_RGB, (False, True): ONLY_B_RGB, (False, False): MASKED_RGB}
    words = {(True, True): "both", (True, False): "only in A", (False, True): "only in B", (False, False): "neither"}
    for q in range(n):
        for kv in range(n):
            x, y = cell_centre(tab, q, kv, n, n)
            key = (bool(in_a[q, kv]), bool(in_b[q, kv]))
            assert close(shown[int(y), int(x)], colours[key]), (q, kv)
    for q, kv in ((3, 1), (7, 6), (2, 0), (5, 0)):
        cell, why = hover(tab, *cell_centre(tab, q, kv, n, n))
        assert cell.splitlines()[-1] == words[(bool(in_a[q, kv]), bool(in_b[q, kv]))]
        assert why == diff_why_text(a, b, [explain(a, 0, q, kv)], [explain(b, 0, q, kv)])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(cases(), st.data())
def test_diff_hover_agrees_with_diff_why_for_random_masks(tab, case, data):
    tree_a, options, frame, valid = case
    tree_b = data.draw(st.sampled_from([("and", [tree_a, ("kind", "causal", {})]), ("or", [tree_a, ("kind", "window", {"window": 2})]),
                                        ("not", tree_a), ("kind", "causal", {})]))
    a, b = build(ref.text(tree_a), MaskOptions(**options)), build(ref.text(tree_b), MaskOptions(**options))
    load(tab, html.diff_page(a, b))
    q0, lq, k0, lk = frame
    q, kv = data.draw(st.integers(q0, q0 + lq - 1)), data.draw(st.integers(k0, k0 + lk - 1))
    cell, why = hover(tab, *cell_centre(tab, q - q0, kv - k0, lq, lk))
    in_a = expected_cells(tree_a, options, frame, valid, a.batch)[0, q - q0, kv - k0]
    in_b = expected_cells(tree_b, options, frame, valid, b.batch)[0, q - q0, kv - k0]
    assert cell.splitlines()[-1] == {(1, 1): "both", (1, 0): "only in A", (0, 1): "only in B", (0, 0): "neither"}[(int(in_a), int(in_b))]
    assert why == diff_why_text(a, b, [explain(a, 0, q, kv)], [explain(b, 0, q, kv)])


def test_blocks_page_says_full_partial_or_empty_as_create_block_mask_counts(tab):
    tree, n, size = ("and", [("kind", "causal", {}), ("kind", "window", {"window": 6})]), 20, 6
    mask = build(ref.text(tree), MaskOptions(length=n))
    load(tab, html.blocks_page(mask, size, size))
    keep = reference(tree, n)
    padded = np.zeros((24, 24), dtype=bool)  # create_block_mask pads to whole blocks: a cut block is never full
    padded[:n, :n] = keep
    for q, kv in ((0, 0), (7, 3), (10, 9), (19, 18), (19, 0), (13, 12)):
        i, j = q // size, kv // size
        block = padded[i * size : (i + 1) * size, j * size : (j + 1) * size]
        cut = (i + 1) * size > n or (j + 1) * size > n
        want = "empty" if not block.any() else "full" if block.all() and not cut else "partial"
        cell, _ = hover(tab, *cell_centre(tab, q, kv, n, n))
        assert cell.splitlines()[-1] == f"{'kept' if keep[q, kv] else 'masked'} · block ({i}, {j}): {want}"
    shown = pixels(tab)
    line = shown[int(6 * tab.size[1] / n), 1:9]  # the grid line under the first row of blocks, dashed, over masked kv 0
    dark = line.sum(axis=1) < 0.7 * sum(MASKED_RGB)  # html.COLOURS["grid"]: black at 0.35 (over the faint cell line)
    assert dark.any() and not dark.all(), line  # dashes and gaps


def page_data(text: str) -> dict:
    start = text.index('<script type="application/json" id="mask-data">') + len('<script type="application/json" id="mask-data">')
    return json.loads(text[start:text.index("</script>", start)])


def block_categories(n: int, size: int, lengths: list[int]) -> list[str]:
    """Per batch row, each block of a causal mask with key padding at `lengths` by a double loop, padded to whole
    blocks as create_block_mask pads them: '0' every cell kept (full), '1' some (partial), '2' none (empty)."""
    blocks = -(-n // size)
    out = []
    for length in lengths:
        row = ""
        for i, j in np.ndindex(blocks, blocks):
            kept = [q < n and kv < n and kv <= q and kv < length
                    for q in range(i * size, (i + 1) * size) for kv in range(j * size, (j + 1) * size)]
            row += "0" if all(kept) else "1" if any(kept) else "2"
        out.append(row)
    return out


def test_blocks_page_data_holds_each_blocks_category_per_batch_row_and_says_when_there_are_too_many(monkeypatch):
    mask = build("causal", MaskOptions(length=11, lengths="11,4"))
    data = page_data(html.blocks_page(mask, 3, 3))
    assert data["blocks"]["map"] == block_categories(11, 3, [11, 4])
    assert [rgb_of(c) for c in data["colours"]["blockTint"]] == [list(rgb) for rgb in html.BLOCK_TINTS]
    monkeypatch.setattr(html, "MAX_PAGE_BLOCKS", 31)  # 2 batch rows x 4 x 4 blocks: past it
    text = html.blocks_page(mask, 3, 3)
    assert page_data(text)["blocks"]["map"] is None
    assert "blocks not tinted: 32 blocks, past the 31 a page tints" in text


def rgb_of(css: str) -> list[int]:
    return [int(v) for v in css[css.index("(") + 1 : css.index(")")].split(",")]


def test_blocks_page_tints_full_partial_and_empty_blocks_over_their_cells(tab):
    n, size = 20, 5
    mask = build("causal", MaskOptions(length=n))
    load(tab, html.blocks_page(mask, size, size), "tinted_blocks.html")
    categories = block_categories(n, size, [n])[0]
    shown = pixels(tab)
    alpha = html.BLOCK_ALPHA  # canvas source-over with globalAlpha: alpha x tint + (1 - alpha) x the cell below
    for q, kv in ((7, 2), (3, 1), (1, 3), (2, 7), (12, 13)):  # full; partial (kept, masked); empty; partial
        category = int(categories[(q // size) * (n // size) + kv // size])
        cell = VISIBLE_RGB if kv <= q else MASKED_RGB
        want = [round(alpha * t + (1 - alpha) * c) for t, c in zip(html.BLOCK_TINTS[category], cell)]
        x, y = cell_centre(tab, q, kv, n, n)
        assert close(shown[int(y), int(x)], want, 3), (q, kv, shown[int(y), int(x)], want)
    assert "full" in tab.inner_text(".legend") and "partial" in tab.inner_text(".legend") and "empty" in tab.inner_text(".legend")


def test_attend_page_shows_every_stage_with_values_and_why(tab):
    import torch
    from typer.testing import CliRunner

    from maskcli.commands import app

    q = [[0.4, -0.1], [0.3, 0.9], [-0.5, 0.2], [0.1, 0.1]]
    k = [[0.2, 0.7], [-0.3, 0.4], [0.8, -0.6], [0.5, 0.5]]
    v = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [2.0, -1.0]]
    path = tab.folder / "attend.html"
    result = CliRunner().invoke(app, ["attend", "document(0,0,1,1) & window(2)", "--q", json.dumps(q), "--k", json.dumps(k),
                                      "--v", json.dumps(v), "--html", str(path)])
    assert result.exit_code == 0, result.output
    tab.emulate_media(color_scheme="light")
    tab.goto(path.as_uri())
    tab.wait_for_function("window.__maskcliFirstDraw !== undefined")
    keep = torch.tensor(reference(DOC_WINDOW_4, 4))
    scores = torch.tensor(q) @ torch.tensor(k).T / (2 ** 0.5)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    mask = build("document(0,0,1,1) & window(2)", MaskOptions(length=4))
    _, _, width, height = box(tab, "#stage-weights")
    shown = pixels(tab, "#stage-masked")
    for i in range(4):
        for j in range(4):
            x, y = (j + 0.5) * width / 4, (i + 0.5) * height / 4
            cell, why = hover(tab, x, y, "#stage-weights")
            lines = dict(line.split(" ", 1) for line in cell.splitlines()[2:] if line.split(" ", 1)[0] in ("scores", "weights"))
            assert float(lines["weights"]) == pytest.approx(float(weights[i, j]), abs=1e-5)
            assert float(lines["scores"]) == pytest.approx(float(scores[i, j] * 2 ** 0.5), abs=1e-5)
            assert why == why_text(mask, [explain(mask, 0, i, j)])
            masked_pixel = shown[int(y), int(x)]
            assert close(masked_pixel, MASKED_RGB) == (not bool(keep[i, j])), (i, j, masked_pixel)
    assert tab.evaluate("document.documentElement.scrollHeight") <= VIEWPORT["height"]  # every stage and the panel in sight
    for name in ("scores", "weights", "output"):  # rulers: a tick per query and key (value dimension) at its centre
        step_k, at_k, _, x_k = ticks(tab, f"ruler-k-{name}")
        step_q, at_q, _, y_q = ticks(tab, f"ruler-q-{name}")
        columns = 2 if name == "output" else 4
        assert step_q == 1 and at_q == [0, 1, 2, 3] and y_q == pytest.approx([(i + 0.5) * height / 4 for i in range(4)])
        assert at_k == list(range(0, columns, step_k)) and x_k == pytest.approx([(j + 0.5) * width / 4 for j in at_k])
    tab.focus("#stage-masked")  # the keyboard walks the cells from the last one read
    tab.keyboard.press("ArrowUp")
    tab.keyboard.press("ArrowLeft")
    assert tab.inner_text("#cell").splitlines()[1:3] == ["q 2 · kv 2", "doc 1 at q · doc 1 at kv"]


DOC_WINDOW_4 = ("and", [("kind", "document", {"labels": [[0, 0, 1, 1]]}), ("kind", "window", {"window": 2})])
MILLION = "document(sizes=[300000,400000,348576]) & window(4096)"


def _million_reference(q: int, kv: int) -> bool:
    label = lambda i: 0 if i < 300000 else 1 if i < 700000 else 2  # noqa: E731
    return label(q) == label(kv) and q - 4096 < kv <= q


def test_a_million_tokens_zooms_to_single_cells_exactly_in_a_small_file(tab):
    mask = build(MILLION)
    path = load(tab, html.mask_page(mask), "million.html")
    assert path.stat().st_size < 20 << 20
    # single cells around the second document boundary: 40 rows x 80 keys, each cell 18 x 9 pixels
    tab.evaluate("window.maskcliViewer.setView(699980, 695920, 40, 80)")
    shown = pixels(tab)
    for i in range(40):
        for j in range(80):
            x, y = cell_centre(tab, i, j, 40, 80)
            want = _million_reference(699980 + i, 695920 + j)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if want else MASKED_RGB), (699980 + i, 695920 + j)
    cell, why = hover(tab, *cell_centre(tab, 25, 70, 40, 80))
    assert cell.splitlines()[:2] == ["q 700005 · kv 695990", "doc 2 at q · doc 1 at kv"]
    assert why == why_text(mask, [explain(mask, 0, 700005, 695990)])
    assert "exact" in tab.text_content("#status")
    # two keys and two queries a pixel: each pixel's colour is the share of its four cells kept, as the figures shade
    # it (any kept cell at least light blue: 0.3 of the way, then the rest by share)
    width, height = tab.size
    tab.evaluate(f"window.maskcliViewer.setView(303000, 300000, {2 * height}, {2 * width})")
    shown = pixels(tab)
    for py in range(3, height, 37):  # off the boundary line at key 300000 (pixel column 0)
        for px in range(3, width, 41):
            share = np.mean([_million_reference(303000 + 2 * py + a, 300000 + 2 * px + c) for a in (0, 1) for c in (0, 1)])
            shade = 0.3 + 0.7 * share if share > 0 else 0.0
            want = np.round(np.array(MASKED_RGB) + (np.array(VISIBLE_RGB) - np.array(MASKED_RGB)) * shade)
            assert close(shown[py, px], want, 1), (py, px, share)


def test_a_sink_column_of_half_a_pixel_is_drawn_light_blue_at_least(tab):
    # 4 keys of 4,096 on a canvas of about 500 pixels: half of the first pixel column, shaded as the figures shade it
    load(tab, html.mask_page(build("causal & (window(1020) | sink(4))", MaskOptions(length=4096))))
    shown, (width, height) = pixels(tab), tab.size
    per_pixel = 4096 / width
    for y in range(int(1100 / 4096 * height), height, 7):  # rows past the window's reach of the first keys
        share = 4 / per_pixel  # the sink's keys, of the pixel's keys
        want = np.round(np.array(MASKED_RGB) + (np.array(VISIBLE_RGB) - np.array(MASKED_RGB)) * (0.3 + 0.7 * share))
        assert close(shown[y, 0], want, 3) and close(shown[y, 2], MASKED_RGB), (y, shown[y, 0])


def test_the_keyboard_pans_zooms_and_resets_and_reads_the_centre_cell(tab):
    mask = build("causal", MaskOptions(length=64))
    load(tab, html.mask_page(mask))
    tab.focus("#mask")
    view = "[window.maskcliViewer.x0, window.maskcliViewer.y0, window.maskcliViewer.sx]"
    side = tab.size[0]
    assert tab.size[1] == side and tab.evaluate(view) == [0, 0, side / 64]
    tab.keyboard.press("+")
    x0, y0, sx = tab.evaluate(view)
    assert sx == 2 * side / 64 and (x0, y0) == (16, 16)
    assert tab.inner_text("#cell").splitlines()[0] == "q 32 · kv 32"
    tab.keyboard.press("ArrowRight")
    tab.keyboard.press("ArrowDown")
    assert tab.evaluate(view)[:2] == [20, 20]
    tab.keyboard.press("0")
    assert tab.evaluate(view) == [0, 0, side / 64]


def test_dark_mode_draws_masked_cells_dark_and_keeps_the_kept_colour(tab):
    load(tab, html.mask_page(build("causal", MaskOptions(length=4))), scheme="dark")
    shown = pixels(tab)
    width, height = tab.size
    assert close(shown[height // 8, width * 7 // 8], html.DARK["masked"]) and close(shown[height * 7 // 8, width // 8], VISIBLE_RGB)
    line = shown[height // 8, round(width / 2)]  # between keys 1 and 2 of row 0, both masked: a faint line at big cells
    assert line.sum() > np.sum(html.DARK["masked"]) + 15 and not close(line, (235, 235, 235), 40)  # not a boundary
    background = tab.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(24, 24, 27)"
    legend = tab.evaluate("getComputedStyle(document.querySelector('.swatch.masked')).backgroundColor")
    assert legend == "rgb({}, {}, {})".format(*html.DARK["masked"])


def test_rows_past_the_budget_are_sampled_and_the_page_says_where_exactness_stops(tab, monkeypatch):
    tree = ("kind", "local", {"chunk_size": 2})  # rows alternate [2i, 2i+1), [2i, 2i+2): no run of affine rows
    mask = build(ref.text(tree), MaskOptions(length=3000))
    monkeypatch.setattr(pagedata, "BUDGET", 5_000)
    load(tab, html.mask_page(mask), "sampled.html")
    assert "NOT exact at this zoom" in tab.text_content("#status")
    tab.evaluate("window.maskcliViewer.setView(1000, 1500, 60, 60)")
    assert "exact: drawn cell by cell" in tab.text_content("#status")
    shown = pixels(tab)
    want = np.array(ref.dense(tree, q0=1000, lq=60, k0=1500, lk=60)[0])
    for i in range(60):
        for j in range(60):
            x, y = cell_centre(tab, i, j, 60, 60)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if want[i, j] else MASKED_RGB), (i, j)
    load(tab, html.blocks_page(mask, 16, 16), "sampled_blocks.html")  # blocks of sampled rows: counted cell by cell
    tab.evaluate("window.maskcliViewer.setView(1000, 1000, 60, 60)")
    for q, kv in ((1010, 1009), (1010, 1030), (1040, 1020)):
        i, j = q // 16, kv // 16
        block = np.array(ref.dense(tree, q0=16 * i, lq=16, k0=16 * j, lk=16)[0])
        word = "empty" if not block.any() else "full" if block.all() else "partial"
        cell, _ = hover(tab, *cell_centre(tab, q - 1000, kv - 1000, 60, 60))
        assert cell.splitlines()[-1].endswith(f"block ({i}, {j}): {word}")


def test_a_tensor_is_drawn_from_its_cells_and_its_why_says_it_has_no_tree(tab):
    keep = np.tril(np.ones((6, 6), dtype=bool), -1)[None, None]
    keep[0, 0, 0, 5] = True
    mask = from_tensor(keep, "given.npy")
    load(tab, html.mask_page(mask))
    shown = pixels(tab)
    for q in range(6):
        for kv in range(6):
            x, y = cell_centre(tab, q, kv, 6, 6)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if keep[0, 0, q, kv] else MASKED_RGB), (q, kv)
    _, why = hover(tab, *cell_centre(tab, 0, 5, 6, 6))
    assert why == why_text(mask, [explain(mask, 0, 0, 5)])


def test_a_short_wide_mask_zooms_along_its_keys(tab):
    load(tab, html.mask_page(build("window(4096)", MaskOptions(length=1, offset=8191))))  # one decode step
    tab.focus("#mask")
    for _ in range(3):
        tab.keyboard.press("+")
    sx, sy = tab.evaluate("[window.maskcliViewer.sx, window.maskcliViewer.sy]")
    width, height = tab.size
    assert sx == pytest.approx(8 * width / 8192) and sy == height
    assert tab.inner_text("#cell").splitlines()[0] == "q 8191 · kv 4096 · q_idx 0 · kv_idx 4096"  # the key at the centre


def test_a_mask_mod_is_drawn_from_its_cells_and_hover_says_the_page_cannot_run_it(tab, tmp_path):
    from typer.testing import CliRunner

    from maskcli.commands import app

    path = tmp_path / "mod.html"
    gym = os.path.join(os.path.dirname(__file__), "data", "gym_masks.py")
    result = CliRunner().invoke(app, ["show", "causal_mask & window(3)", "--mask-mod", f"{gym}:causal_mask", "--len", "6",
                                      "--tokens", "a b c d e f", "--html", str(path)])
    assert result.exit_code == 0, result.output
    load(tab, path.read_text())
    want = np.array(ref.dense(("kind", "window", {"window": 3}), q0=0, lq=6, k0=0, lk=6)[0])
    shown = pixels(tab)
    for q in range(6):
        for kv in range(6):
            x, y = cell_centre(tab, q, kv, 6, 6)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if want[q, kv] else MASKED_RGB), (q, kv)
    cell, why = hover(tab, *cell_centre(tab, 4, 2, 6, 6))
    assert cell.splitlines() == ["q 4 · kv 2", '"e" at q · "c" at kv', "kept"]
    assert why.startswith("this mask calls your mask_mod, which the page cannot run")


HOSTILE_TOKENS = ["<!--<script>", "</script><script>window.__pwned=1</script>", "a&amp;b<b>", "d"]


def hostile_page(tmp_path):
    """The page `show causal --tokens '<!--<script> ...' --html` writes: tokens that would end or re-open its script."""
    from typer.testing import CliRunner

    from maskcli.commands import app

    path = tmp_path / "o.html"
    result = CliRunner().invoke(app, ["show", "causal", "--tokens", " ".join(HOSTILE_TOKENS), "--html", str(path)])
    assert result.exit_code == 0, result.output
    return path.read_text(encoding="utf-8")


def test_json_in_the_page_has_no_character_that_could_end_or_reopen_its_script(tmp_path):
    text = hostile_page(tmp_path)
    start = text.index('<script type="application/json" id="mask-data">') + len('<script type="application/json" id="mask-data">')
    payload = text[start:text.index("</script>", start)]
    assert not set("<>&\u2028\u2029") & set(payload)
    assert json.dumps(json.loads(payload)).count("<!--<script>") == 1  # the \u escapes read back as the tokens
    odd = {"s": "<!--<script></script>&\u2028\u2029"}
    assert json.loads(html.script_json(odd)) == odd and not set("<>&\u2028\u2029") & set(html.script_json(odd))


def test_tokens_that_look_like_html_render_as_text_and_run_nothing(tab, tmp_path):
    load(tab, hostile_page(tmp_path))  # waits for the first draw, and no page error
    assert tab.evaluate("window.__pwned") is None
    assert close(pixels(tab)[int(cell_centre(tab, 1, 0, 4, 4)[1]), int(cell_centre(tab, 1, 0, 4, 4)[0])], VISIBLE_RGB)
    cell, _ = hover(tab, *cell_centre(tab, 1, 0, 4, 4))
    assert cell.splitlines()[1] == f'"{HOSTILE_TOKENS[1]}" at q · "{HOSTILE_TOKENS[0]}" at kv'


def test_the_worst_rows_at_a_million_tokens_stay_under_20_mb_and_exact_at_cells(tab):
    import maskcli

    mask = maskcli.build("document & window(4096)", sizes=[2] * (1 << 19))  # 524,288 two-token documents
    path = load(tab, html.mask_page(mask), "worst.html")
    assert path.stat().st_size < 20 << 20
    assert "NOT exact at this zoom" in tab.text_content("#status")
    tab.evaluate("window.maskcliViewer.setView(777770, 777760, 20, 20)")
    assert "exact: drawn cell by cell from the expression" in tab.text_content("#status")
    shown = pixels(tab)
    for i in range(20):
        for j in range(20):
            q, kv = 777770 + i, 777760 + j
            x, y = cell_centre(tab, i, j, 20, 20)
            assert close(shown[int(y), int(x)], VISIBLE_RGB if q // 2 == kv // 2 and kv <= q else MASKED_RGB), (q, kv)
    cell, why = hover(tab, *cell_centre(tab, 5, 14, 20, 20))
    assert cell.splitlines()[1] == "doc 388887 at q · doc 388887 at kv"
    assert why == why_text(mask, [explain(mask, 0, 777775, 777774)])


def test_labels_that_change_too_often_for_a_page_are_refused_in_one_line():
    import maskcli
    from maskcli.errors import MaskError

    mask = maskcli.build("document", sizes=[1] * (1 << 20))  # a document per token: 1,048,576 label runs
    with pytest.raises(MaskError) as refused:
        html.mask_page(mask)
    message = str(refused.value)
    assert message.startswith("--html: the labels, ids and padding of 'document(sizes=[1,1,1,") and "\n" not in message
    assert message.endswith("make 1,048,576 runs of equal values, past the 750,000 a page holds: view a region with --rows/--keys")


# --- layout and rulers -----------------------------------------------------------------------------------------------

def until(tab, expression: str, seconds: float = 10):
    """Poll the page (its CSP forbids the eval that wait_for_function polls with) until the expression holds."""
    import time

    end = time.monotonic() + seconds
    while not tab.evaluate(expression):
        assert time.monotonic() < end, expression
        time.sleep(0.05)


def ticks(tab, ruler: str) -> tuple[int, list[int], list[str], list[float]]:
    """A ruler's step, its tick positions and labels, and each tick's offset along the canvas in pixels."""
    return tab.evaluate("""(id) => { const el = document.getElementById(id), ts = [...el.querySelectorAll('.tick')];
        const side = el.classList.contains('k') ? 'left' : 'top';
        return [Number(el.dataset.step), ts.map((t) => Number(t.dataset.pos)), ts.map((t) => t.textContent),
                ts.map((t) => parseFloat(t.style[side]))]; }""", ruler)


def round_label(t: int, step: int) -> str:
    """How a ruler names a position: 200k and 1M where the step is in thousands, else the number."""
    if t == 0 or step % 1000:
        return str(t)
    return f"{t // 10 ** 6}M" if t % 10 ** 6 == 0 else f"{t // 1000}k"


def check_ruler(tab, ruler: str, first: int, last: int, pixels_per_cell: float, min_gap: float):
    """The ruler's ticks are every multiple of a round step among the positions first..last in view, each at its
    cell's centre, named as round_label names it, no closer than min_gap pixels."""
    step, at, labels, offsets = ticks(tab, ruler)
    digits = len(str(step)) - 1
    assert step // 10 ** digits in (1, 2, 5) and step % 10 ** digits == 0, step
    assert at == [t for t in range(-(-first // step) * step, last + 1, step)], (first, last, step, at)
    assert labels == [round_label(t, step) for t in at]
    assert offsets == pytest.approx([(t - first + 0.5) * pixels_per_cell for t in at], abs=0.01)
    assert step * pixels_per_cell >= min_gap and len(at) >= 3 or last - first < 3 * step
    return step, at, offsets


def test_rulers_name_absolute_positions_at_round_steps_and_follow_the_view(tab):
    mask = build(MILLION)
    load(tab, html.mask_page(mask), "rulers.html")
    width, height = tab.size
    step, at, _ = check_ruler(tab, "ruler-k", 0, 1048575, width / 1048576, 40)
    assert step in (100000, 200000) and ticks(tab, "ruler-k")[2][:2] == ["0", f"{step // 1000}k"]
    check_ruler(tab, "ruler-q", 0, 1048575, height / 1048576, 20)
    # a region of 40 queries x 80 keys: its positions, computed here from the view asked for
    tab.evaluate("window.maskcliViewer.setView(699980, 695920, 40, 80)")
    check_ruler(tab, "ruler-k", 695920, 695999, width / 80, 40)
    check_ruler(tab, "ruler-q", 699980, 700019, height / 40, 20)
    # zoomed by the wheel somewhere: hovering at a key tick and a query tick reads that very cell, kept as defined
    tab.evaluate("window.maskcliViewer.setView(699800, 695800, 601, 601)")  # cells of 510/601 px: the pointer is inside one
    left, top, _, _ = box(tab)
    px, py = int(width * 0.3), int(height * 0.6)
    tab.mouse.move(left + px, top + py)
    for _ in range(8):
        tab.mouse.wheel(0, -100)
    until(tab, "window.maskcliViewer.sx > 5")
    _, keys, _, xs = ticks(tab, "ruler-k")
    _, queries, _, ys = ticks(tab, "ruler-q")
    # the wheel zooms about the pointer: the panel names the cell under it, where the rulers place it (at cells' centres)
    under = [at[0] + (pointer - offset[0]) * (at[1] - at[0]) / (offset[1] - offset[0])
             for at, offset, pointer in ((keys, xs, px), (queries, ys, py))]
    assert all(abs(p % 1 - 0.5) > 0.05 for p in under), under  # off the cells' edges
    kv, q = (int(np.floor(p + 0.5)) for p in under)
    assert tab.inner_text("#cell").splitlines()[0] == f"q {q} · kv {kv}", under
    for kv, x in list(zip(keys, xs))[:3]:
        for q, y in list(zip(queries, ys))[:3]:
            cell, why = hover(tab, x, y)
            assert cell.splitlines()[0] == f"q {q} · kv {kv}"
            assert cell.splitlines()[-1] == ("kept" if _million_reference(q, kv) else "masked")
            assert why == why_text(mask, [explain(mask, 0, q, kv)])


def test_rulers_of_a_decode_step_and_a_prefill_behind_a_cache_read_their_absolute_positions(tab):
    load(tab, html.mask_page(build("window(4096)", MaskOptions(length=1, offset=1000))), "decode.html")
    width, height = tab.size
    assert height >= 32 and ticks(tab, "ruler-q")[1:3] == [[1000], ["1000"]]
    check_ruler(tab, "ruler-k", 0, 1000, width / 1001, 40)
    load(tab, html.mask_page(build("window(4096)", MaskOptions(length=16, offset=100000))), "prefill.html")
    width, height = tab.size
    assert height / 16 >= 30  # rows tall enough to hover (32 px where the window has room)
    assert check_ruler(tab, "ruler-q", 100000, 100015, height / 16, 20)[0] == 1
    check_ruler(tab, "ruler-k", 0, 100015, width / 100016, 40)
    assert tab.text_content("#marks-k .cache") == "KV cache | new keys"


PAGES = {  # page kinds at their hardest shapes for the layout
    "show, a million tokens": lambda: html.mask_page(build(MILLION)),
    "show, a prefill of 16 behind 100k": lambda: html.mask_page(build("window(4096)", MaskOptions(length=16, offset=100000))),
    "show, a decode step": lambda: html.mask_page(build("window(4096)", MaskOptions(length=1, offset=1000))),
    "diff": lambda: html.diff_page(build("window(4095)", MaskOptions(length=65536)), build("window(4096)", MaskOptions(length=65536))),
    "blocks": lambda: html.blocks_page(build("document(sizes=[300,500,224]) & window(128)"), 64, 64),
}


@pytest.mark.parametrize("kind", PAGES)
def test_the_map_and_its_hover_panel_fit_the_window_without_scrolling(tab, kind):
    load(tab, PAGES[kind](), "fit.html")
    width, height = tab.size
    lq, lk = tab.evaluate("[window.maskcliViewer.lq, window.maskcliViewer.lk]")
    hover(tab, width * 0.7, height * 0.6)
    rects = tab.evaluate("""() => Object.fromEntries(['#mask', 'aside .scroll', '#cell', '#why', '#ruler-k', '#ruler-q']
        .map((s) => { const r = document.querySelector(s).getBoundingClientRect(); return [s, [r.left, r.top, r.right, r.bottom]]; }))""")
    scroll = tab.evaluate("[document.documentElement.scrollHeight, document.documentElement.scrollWidth]")
    assert scroll[0] <= VIEWPORT["height"] and scroll[1] <= VIEWPORT["width"], scroll  # nothing below the fold
    for name, (left, top, right, bottom) in rects.items():
        assert 0 <= left and right <= VIEWPORT["width"] and 0 <= top and bottom <= VIEWPORT["height"], (name, rects[name])
    assert rects["aside .scroll"][0] >= rects["#mask"][2]  # the panel beside the map: hover text in sight
    if lk / lq > 4:  # a short, wide mask fills the width it has, with rows tall enough to hover
        assert height / lq >= 30 and width >= 540, (width, height)
    else:
        assert width == height or lk != lq
    assert min(width, height) >= 480 or lq * 32 <= height


def test_the_map_follows_the_window_and_puts_the_panel_below_on_a_narrow_one(tab):
    load(tab, html.mask_page(build("causal", MaskOptions(length=4096))), "resize.html")
    small = tab.size
    try:
        tab.set_viewport_size({"width": 1400, "height": 900})
        until(tab, f"document.getElementById('mask').width > {small[0]}")
        wide = size(tab)
        assert wide[0] == wide[1] and tab.evaluate("document.documentElement.scrollHeight") <= 900
        tab.set_viewport_size({"width": 600, "height": 800})
        until(tab, "document.getElementById('mask').width < 600")
        canvas, panel = tab.evaluate("""() => ['#mask', 'aside .scroll'].map((s) => {
            const r = document.querySelector(s).getBoundingClientRect(); return [r.right, r.top, r.bottom]; })""")
        assert canvas[0] <= 600 and panel[1] >= canvas[2]  # below the map, within the width
    finally:
        tab.set_viewport_size(VIEWPORT)


def test_a_diff_of_one_key_per_row_shows_at_the_whole_mask_zoom(tab):
    a, b = build("window(4095)", MaskOptions(length=65536)), build("window(4096)", MaskOptions(length=65536))
    load(tab, html.diff_page(a, b), "one_key.html")  # over 100 keys a pixel: each row differs in one cell, only in B
    assert "differing cells shown as at least half" in tab.text_content("#status")
    shown = pixels(tab).reshape(-1, 3)
    nearest = np.argmin([np.abs(shown - np.array(rgb)).sum(axis=1) for rgb in (VISIBLE_RGB, MASKED_RGB, LEAK_RGB, ONLY_B_RGB)], axis=0)
    width, height = tab.size
    assert np.count_nonzero(nearest == 3) >= min(width, height) // 2  # along the band's edge, about a pixel a row
    assert np.count_nonzero(nearest == 2) == 0  # window(4095) keeps nothing window(4096) masks


def test_serve_page_draws_each_request_its_pages_and_opens_a_findings_cell(tab):
    """serve's page (render/servepage.py, serve.js): request 0 of a vLLM window-4 batch (query 12, keys 9..12 seen) and,
    chosen in the selector, request 1 (causal 0..3), each cell checked against a double loop; request 0's pages strip
    coloured block by block as render/serve.py's figure colours them; hover on a block names its page and who shares
    it; a click on the finding shows its cell."""
    from maskcli.render.serve import PAGE_COLOURS, finding_json, request_rows
    from maskcli.render.servepage import serve_page
    from maskcli.checks.serve import check
    from maskcli.serve.engines import from_tensors
    from maskcli.checks.pagemap import page_map
    from serve_builders import Req, vllm

    batch = from_tensors(vllm([Req(12, 1, [5, 6, 1, 4]), Req(0, 4, [1])], 4, sliding_window=4), "batch.json")
    findings = [finding_json(f) for f in check(batch)]
    load(tab, serve_page(batch, request_rows(batch, page_map(batch)), findings, "batch.json", "vLLM"), "serve.html")
    for r, (q0, lq, lk) in enumerate(((12, 1, 13), (0, 4, 4))):
        if r:
            tab.select_option("#request", "1")
            tab.size = size(tab)
        shown = pixels(tab)
        for q in range(lq):
            for kv in range(lk):
                x, y = cell_centre(tab, q, kv, lq, lk)
                keep = q0 + q - 4 < kv <= q0 + q
                assert close(shown[int(y), int(x)], VISIBLE_RGB if keep else MASKED_RGB), (r, q, kv)
    tab.click("#requests tbody tr[data-request='0']")
    strip = pixels(tab, "#pages")
    width = strip.shape[1]
    for block, kind in enumerate(("unread", "unread", "shared", "written")):  # blocks 0, 1 before the window
        x = int((block + 0.5) * width / 4)
        assert close(strip[strip.shape[0] // 2, x], np.array(PAGE_COLOURS[kind]) * 255, 3), (block, kind)
    cell, why = hover(tab, 2.5 * width / 4, 10, "#pages")
    assert cell.splitlines() == ["request 0 · logical block 2 → page 1", "keys 8-11 · fill 4/4"]
    assert why == "shared with another request: request 1 also reads page 1"
    assert tab.inner_text("#findings h2") == "findings (1)"
    tab.click("#findings li.wrong")
    assert tab.inner_text("#cell").splitlines()[0] == "q 12 · kv 9 · q_idx 0 · kv_idx 9"
    keyless = from_tensors({"cu_seqlens_q": [0, 2, 3], "seqused_k": [0, 4], "causal": 1}, "flash.json")  # no page table
    findings = [finding_json(f) for f in check(keyless)]
    load(tab, serve_page(keyless, request_rows(keyless, page_map(keyless)), findings, "flash.json", "flash-attn"), "keyless.html")
    assert tab.evaluate("[...document.querySelectorAll('#request option')].map((o) => o.text)") == ["request 1: causal"]
    assert tab.is_hidden("#pagemap")
    tab.click("#findings li.wrong")  # no-keys, request 0: nothing to draw, and the panel says why
    assert tab.is_hidden("#plot") and tab.text_content("#why") == "request 0 has no mask to draw: it has no keys"
    assert tab.errors == []
