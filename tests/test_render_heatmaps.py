"""Figures read back from disk: the colour at the centre of every cell is the mask's."""

from __future__ import annotations

import matplotlib.image as mpimg
import numpy as np
import pytest
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.render.heatmaps import MASKED_RGB, VISIBLE_RGB
import definitions as ref

runner = CliRunner()
TOLERANCE = 3  # PNG colours come back within rounding of the RGB we asked for


def draw(args, path):
    result = runner.invoke(app, [*map(str, args), "--png", str(path)])
    assert result.exit_code == 0, result.output
    assert f"wrote {path}" in result.stderr
    return (mpimg.imread(path)[..., :3] * 255).round().astype(int)


def is_colour(rgb, colour):
    return (np.abs(rgb - np.array(colour)) <= TOLERANCE).all(axis=-1)


def runs(flags, gap):
    """(start, stop) of runs of True, joining runs separated by at most `gap` False entries."""
    out = []
    for index in np.flatnonzero(flags):
        if out and index - out[-1][1] <= gap:
            out[-1][1] = index + 1
        else:
            out.append([index, index + 1])
    return [tuple(run) for run in out]


def heatmap_boxes(rgb):
    """(top, bottom, left, right) of each heatmap area, left to right.

    A heatmap area is a block of pixels in the two mask colours; the white cell-grid
    lines cut it into strips, so gaps of a few pixels are joined. The legend swatches
    share the colours but are a few pixels tall, far below the threshold.
    """
    ours = is_colour(rgb, VISIBLE_RGB) | is_colour(rgb, MASKED_RGB)
    per_column = ours.sum(axis=0)
    boxes = []
    for left, right in runs(per_column > per_column.max() / 2, gap=4):
        per_row = ours[:, left:right].sum(axis=1)
        (top, bottom), *rest = sorted(runs(per_row > (right - left) / 2, gap=4), key=lambda r: r[0] - r[1])
        boxes.append((top, bottom, left, right))
    return boxes


def cells(rgb, box, q_len, k_len):
    """1 where a cell's centre (and the pixels around it) is the visible colour, 0 the masked one, -1 neither."""
    top, bottom, left, right = box
    out = np.full((q_len, k_len), -1)
    for i in range(q_len):
        for j in range(k_len):
            y = int(top + (i + 0.5) * (bottom - top) / q_len)
            x = int(left + (j + 0.5) * (right - left) / k_len)
            patch = rgb[y - 1 : y + 2, x - 1 : x + 2]
            if is_colour(patch, VISIBLE_RGB).all():
                out[i, j] = 1
            elif is_colour(patch, MASKED_RGB).all():
                out[i, j] = 0
    return out


CAUSAL = ("kind", "causal", {})
DOCS = [0, 0, 0, 1, 1, 2, 2, 2]
FIGURES = [
    (["show", "causal", "--len", "6"], CAUSAL, 6, 0),
    (["show", "prefill", "--offset", "3", "--len", "2"], CAUSAL, 2, 3),
    (["show", "window", "--len", "9", "--window", "3"], ("kind", "window", {"window": 3}), 9, 0),
    (["show", "document", "--chunks", "0,0,0,1,1,2,2,2"], ("kind", "document", {"labels": [DOCS]}), 8, 0),
    (["show", "document(0,0,0,1,1,2,2,2) & window(2) | sink(1)"],
     ("or", [("and", [("kind", "document", {"labels": [DOCS]}), ("kind", "window", {"window": 2})]), ("kind", "sink", {"sink": 1})]), 8, 0),
    (["show", "tree(-1,0,0,1,2)", "--offset", "2"], ("kind", "tree", {"parents": [-1, 0, 0, 1, 2]}), 5, 2),
    (["chunk", "0,0,1,1,1,1,2,2,2,3,4,4", "--tokens", "a b c d e f g h i j k l"],
     ("kind", "chunk", {"labels": [[0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4]]}), 12, 0),
]


@pytest.mark.parametrize("args, tree, q_len, offset", FIGURES, ids=[" ".join(f[0]) for f in FIGURES])
def test_png_cells_show_the_mask(tmp_path, args, tree, q_len, offset):
    rgb = draw(args, tmp_path / "mask.png")
    k_len = q_len + offset
    (box,) = heatmap_boxes(rgb)
    top, bottom, left, right = box
    # square cells: the heatmap's sides are in the ratio Lk : Lq
    assert abs((right - left) / (bottom - top) - k_len / q_len) < 0.05 * k_len / q_len
    expected = np.array(ref.dense(tree, q0=offset, lq=q_len, k0=0, lk=k_len)[0], dtype=int)
    assert (cells(rgb, box, q_len, k_len) == expected).all()


@pytest.mark.parametrize("args, lengths", [
    (["show", "padding", "--lengths", "4,2"], [4, 2]),
    (["show", "causal", "--len", "5", "--lengths", "5,3,1"], [5, 3, 1]),
])
def test_one_panel_per_batch_row(tmp_path, args, lengths):
    rgb = draw(args, tmp_path / "padding.png")
    boxes = heatmap_boxes(rgb)
    n = max(lengths)
    assert len(boxes) == len(lengths)
    tree = ("kind", args[1], {}) if args[1] != "padding" else ("kind", "full", {})
    expected = ref.dense(tree, q0=0, lq=n, k0=0, lk=n, batch=len(lengths), valid=[[k < m for k in range(n)] for m in lengths])
    for box, plane in zip(boxes, expected):
        assert (cells(rgb, box, n, n) == np.array(plane, dtype=int)).all()


def test_a_million_token_band_is_drawn_on_every_row_of_pixels(tmp_path):
    rgb = draw(["show", "window(128)", "--len", "1048576"], tmp_path / "band.png")
    (box,) = heatmap_boxes(rgb)
    top, bottom, left, right = box
    tinted = ~is_colour(rgb[top:bottom, left:right], MASKED_RGB)  # a pixel with any visible cell is not the masked grey
    rows_with_band = tinted.any(axis=1)
    assert rows_with_band[2:-2].all()  # exact shares: the 128-wide band shows at 2,048 cells per pixel
    assert tinted.mean() < 0.05


def test_a_long_mask_is_drawn_as_shares(tmp_path):
    rgb = draw(["show", "causal", "--len", "600"], tmp_path / "long.png")
    # well away from the diagonal: the lower-left corner is all visible, the upper-right all masked
    (box,) = heatmap_boxes(rgb)
    top, bottom, left, right = box
    h, w = bottom - top, right - left
    assert is_colour(rgb[top + int(0.8 * h), left + int(0.2 * w)], VISIBLE_RGB)
    assert is_colour(rgb[top + int(0.2 * h), left + int(0.8 * w)], MASKED_RGB)


def test_a_sink_column_thinner_than_two_pixels_shows_at_the_panels_edge(tmp_path):
    # 4,096 keys drawn as 512 blocks of 8: the sink's 4 keys are half of the first block column, 1.4 pixels wide, and
    # the axes' frame was drawn over it (issue 28, item 15)
    rgb = draw(["show", "causal & (window(1020) | sink(4))", "--len", 4096], tmp_path / "sink.png")
    (box,) = heatmap_boxes(rgb)
    top, bottom, left, right = box
    edge = left - 1  # the column of pixels left of the grey and blue: half-kept blocks, shaded 0.3 + 0.7 x 0.5
    want = np.round(np.array(MASKED_RGB) + (np.array(VISIBLE_RGB) - np.array(MASKED_RGB)) * (0.3 + 0.7 * 0.5))
    rows = [y for y in range(top, bottom) if (y - top + 0.5) * 4096 / (bottom - top) > 1100  # past the window's reach,
            and abs((y - top + 0.5) * 4096 / (bottom - top) % 1000 - 500) < 480]  # off the axis's ticks at 1000s
    assert len(rows) > 400
    for y in rows:
        q = int((y - top + 0.5) * 4096 / (bottom - top))
        kept = [k for k in range(8) if k <= q and (k < 4 or q - k < 1020)]  # the definition, on the block's 8 keys
        # within a few levels: matplotlib resamples the 1.4-pixel blocks onto whole pixels
        assert len(kept) == 4 and np.abs(rgb[y, edge] - want).max() <= 8, (y, q, rgb[y, edge])
        assert is_colour(rgb[y, left + 2], MASKED_RGB) and rgb[y, edge - 1].min() > 200  # masked beside; no dark frame line


@pytest.mark.parametrize("suffix, magic, tail", [
    (".png", b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"),
    (".svg", b"<?xml", b"</svg>\n"),
    (".pdf", b"%PDF-", b"%%EOF\n"),
    (".PDF", b"%PDF-", b"%%EOF\n"),
])
def test_the_extension_picks_the_format(tmp_path, suffix, magic, tail):
    path = tmp_path / f"mask{suffix}"
    result = runner.invoke(app, ["show", "causal", "--len", "4", "--png", str(path)])
    assert result.exit_code == 0, result.output
    data = path.read_bytes()
    assert data.startswith(magic) and data.endswith(tail)  # whole, not cut short
    if suffix == ".svg":
        assert b"<svg" in data
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it


@pytest.fixture
def broken_savefig(monkeypatch):
    """Figure.savefig writes half a file, then fails the way a full disk does."""
    import matplotlib.figure

    def broken(self, fname, *args, **kwargs):
        with open(fname, "wb") as handle:
            handle.write(b"\x89PNG half a figure")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)


def test_a_failed_write_leaves_no_file(tmp_path, broken_savefig):
    result = runner.invoke(app, ["show", "causal", "--len", "4", "--png", str(tmp_path / "m.png")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ") and "No space left on device" in line and "m.png" in line
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_old_file(tmp_path, broken_savefig):
    old = tmp_path / "m.png"
    old.write_bytes(b"the figure from yesterday")
    result = runner.invoke(app, ["chunk", "0,0,1", "--png", str(old)])
    assert result.exit_code == 2, result.output
    assert old.read_bytes() == b"the figure from yesterday"
    assert list(tmp_path.iterdir()) == [old]


def test_an_unexpected_failure_while_writing_leaves_no_file(tmp_path, monkeypatch):
    import matplotlib.figure

    def broken(self, fname, *args, **kwargs):
        with open(fname, "wb") as handle:
            handle.write(b"partial")
        raise RuntimeError("renderer crashed")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    result = runner.invoke(app, ["show", "causal", "--len", "4", "--png", str(tmp_path / "m.svg")])
    assert result.exit_code != 0
    assert list(tmp_path.iterdir()) == []


def test_a_short_wide_mask_fills_its_panel_and_positions_read_as_round_numbers(tmp_path):
    from matplotlib import image as mpimg
    from typer.testing import CliRunner

    from maskcli.commands import app

    path = tmp_path / "prefill.png"
    assert CliRunner().invoke(app, ["show", "window(4096)", "--offset", "1000", "--len", "16", "--png", str(path)]).exit_code == 0
    pixels = mpimg.imread(path)[..., :3]
    blue = np.all(np.abs(pixels - np.array([31, 119, 180]) / 255) < 0.06, axis=-1)  # the visible cells' colour
    rows = np.flatnonzero(blue.any(axis=1))
    assert rows.size > 100  # 16 queries drawn over 100+ pixel rows (equal aspect drew them about 10 pixels tall)
    figure = mask_figure_for("document(sizes=[300000,748576]) & window(4096)")
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert "200k" in labels and not any("e" in label for label in labels)  # no 1e6 offset


def mask_figure_for(expression):
    from maskcli.mask import build
    from maskcli.render.masks import mask_figure

    figure = mask_figure(build(expression))
    figure.canvas.draw()
    return figure


def _value(label: str) -> int:
    """A tick label read back as a position: 950, 12.5k, 1.05M (never an offset like 1e6)."""
    scale = {"k": 1_000, "M": 1_000_000}.get(label[-1:], 1)
    return round(float(label.rstrip("kM")) * scale)


def _ticks_on_cells(figure, k_start, k_len, q_start, q_len):
    """Each tick's (axis, label, where it stands as a share of the image, where the centre of that position's cell is)."""
    figure.canvas.draw()
    ax = figure.axes[0]
    box = ax.images[0].get_window_extent()
    found = []
    for ticks, start, length, lo, size, index in ((ax.get_xticks(), k_start, k_len, box.x0, box.width, 0),
                                                  (ax.get_yticks(), q_start, q_len, box.y1, -box.height, 1)):
        labels = [t.get_text() for t in (ax.get_xticklabels() if index == 0 else ax.get_yticklabels())]
        for tick, label in zip(ticks, labels):
            where = ax.transData.transform((tick, tick))[index]
            if label and (where - lo) / size >= 0 and (where - lo) / size <= 1:
                found.append(("xy"[index], label, (where - lo) / size, (_value(label) - start + 0.5) / length))
    assert ax.xaxis.get_offset_text().get_text() == "" and ax.yaxis.get_offset_text().get_text() == ""
    return found


@pytest.mark.parametrize("args, k_start, k_len, q_start, q_len", [
    (["causal", "--len", "6"], 0, 6, 0, 6),  # small: tick k at the centre of column k
    (["window(3)", "--offset", "1000", "--len", "4", "--kv-start", "970"], 970, 34, 1000, 4),  # behind a cache
    (["causal", "--offset", "996", "--len", "4", "--kv-start", "900"], 900, 100, 996, 4),
    (["document(sizes=[300000,748576]) & window(4096)"], 0, 1048576, 0, 1048576),  # a pixel per 2,048 positions
])
def test_ticks_stand_at_the_centres_of_their_positions_cells_with_round_labels(args, k_start, k_len, q_start, q_len):
    from maskcli.mask import MaskOptions, build
    from maskcli.render.masks import mask_figure

    flags = dict(zip(args[1::2], args[2::2]))
    options = MaskOptions(length=int(flags["--len"]) if "--len" in flags else None,
                          offset=int(flags["--offset"]) if "--offset" in flags else None,
                          kv_start=int(flags["--kv-start"]) if "--kv-start" in flags else None)
    found = _ticks_on_cells(mask_figure(build(args[0], options)), k_start, k_len, q_start, q_len)
    cell = 1 / min(k_len, 512)  # a cell, or a pixel block of a long mask
    for _, label, at, centre in found:
        assert abs(at - centre) < cell / 10, (label, at, centre)  # at the centre of that position's cell
        assert "e" not in label
    for axis, length in (("x", k_len), ("y", q_len)):
        values = [_value(label) for a, label, _, _ in found if a == axis]
        steps = {b - a for a, b in zip(values, values[1:])}
        assert len(values) >= min(length, 4) and len(steps) == 1, (axis, values)
        step = steps.pop()  # one round step: 1, 2 or 5 times a power of ten, and every label a multiple of it
        assert step // 10 ** (len(str(step)) - 1) in (1, 2, 5) and step % 10 ** (len(str(step)) - 1) == 0, values
        assert all(value % step == 0 for value in values), values
