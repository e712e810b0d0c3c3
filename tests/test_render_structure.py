"""Structure marks: label segments, the cache line, padding and the diagonal, computed and read back from pixels."""

from __future__ import annotations

import io

import matplotlib.image as mpimg
import numpy as np
import pytest

from maskcli.mask import MaskOptions, build
from maskcli.render.masks import mask_figure
from maskcli.render.structure import CACHE_RGB, DIAGONAL_RGB, MARK_RGB, structure


def runs_by_loop(values, offset=0):
    """(start, end, value) of equal runs, one position at a time: the reference."""
    out = []
    for position, value in enumerate(values):
        if out and out[-1][2] == value and out[-1][1] == position + offset:
            out[-1][1] += 1
        else:
            out.append([position + offset, position + offset + 1, value])
    return [tuple(run) for run in out]


@pytest.mark.parametrize("labels", [[0, 0, 0, 1, 1, 2, 2, 2], [3, 1, 1, 3], [0], [5, 5, 5, 5]])
def test_segments_are_the_runs_of_the_labels(labels):
    text = ",".join(map(str, labels))
    for kind in ("document", "segment", "chunk", "blocks"):
        found = structure(build(f"{kind}({text})", MaskOptions()), 0)
        assert list(found.segments) == runs_by_loop(labels)
        assert found.word in ("doc", "seg", "chunk", "block")


def test_padding_cache_and_local_chunks():
    padded = build("causal", MaskOptions(ids="0,0,5,6;7,8,9,0"))
    assert structure(padded, 0).pad_keys == ((0, 2),) and structure(padded, 0).pad_queries == ((0, 2),)
    assert structure(padded, 1).pad_keys == ((3, 4),)
    lengths = build("causal", MaskOptions(lengths="4,2"))
    assert structure(lengths, 1).pad_keys == ((2, 4),) and structure(lengths, 0).pad_keys == ()
    cached = structure(build("causal", MaskOptions(offset=3, length=2)), 0)
    assert cached.cached and (cached.q_start, cached.k_start) == (3, 0)
    assert not structure(build("causal", MaskOptions(length=4)), 0).cached
    local = structure(build("local(3)", MaskOptions(length=8)), 0)
    assert local.segments == ((0, 3, 0), (3, 6, 1), (6, 8, 2))
    assert structure(build("window(2)", MaskOptions(length=4)), 0).segments == ()
    # Llama 4 with left padding: the chunks count from each row's first real token
    left = build("local(3)", MaskOptions(ids="0,0,5,6,7,8,9,4;1,2,3,4,5,6,7,8"))
    assert structure(left, 0).segments == ((2, 5, 0), (5, 8, 1)) and structure(left, 1).segments == ((0, 3, 0), (3, 6, 1), (6, 8, 2))
    # packed documents: the chunks start again at each document (runs of equal labels)
    packed = structure(build("local(2, documents=[0,0,0,0,0,1,1,1])", MaskOptions()), 0)
    assert packed.segments == ((0, 2, 0), (2, 4, 1), (4, 5, 2), (5, 7, 3), (7, 8, 4))


def rendered(expression, **options):
    figure = mask_figure(build(expression, MaskOptions(**options)))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    buffer.seek(0)
    return figure, mpimg.imread(buffer)


def near(image, ax, x, y, colour, tolerance=40):
    """Whether a pixel within two of (x, y) in data coordinates is `colour` (0-1 floats)."""
    px, py = ax.transData.transform((x, y))
    row, col = int(round(image.shape[0] - py)), int(round(px))
    patch = image[row - 2 : row + 3, col - 2 : col + 3, :3] * 255
    return bool((np.abs(patch - np.array(colour) * 255).max(axis=-1) <= tolerance).any())


def test_boundaries_cache_line_and_diagonal_are_drawn_where_they_belong():
    figure, image = rendered("document(0,0,0,1,1,2,2,2)", offset=2, length=6)
    ax = figure.axes[0]
    # queries 2-7 over keys 0-7: the doc boundaries at keys 3 and 5 are vertical lines at x = 2.5 and 4.5
    for row in (1.0, 3.0, 5.0):
        assert near(image, ax, 2.5, row, MARK_RGB) and near(image, ax, 4.5, row, MARK_RGB)
        assert not near(image, ax, 3.5, row, MARK_RGB)  # none inside a document
    # and horizontal ones at queries 3 and 5: y = 0.5 and 2.5 (row 0 is query 2)
    assert near(image, ax, 6.0, 0.5, MARK_RGB) and near(image, ax, 6.0, 2.5, MARK_RGB)
    # the cache ends before query 2: a dashed line at x = 1.5, somewhere along its length
    assert any(near(image, ax, 1.5, y, CACHE_RGB) for y in np.linspace(0, 5, 21))
    # the diagonal: along the right edge of cell (query 4, key 4), i.e. x = 4.5 on row 2
    assert any(near(image, ax, 4.5, y, DIAGONAL_RGB) for y in np.linspace(1.6, 2.4, 9))
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert any(t.startswith("doc boundary") for t in legend) and any(t.startswith("cached keys") for t in legend)


def test_padding_is_a_band_beside_the_cells_and_leaves_them_their_colour():
    from maskcli.render.heatmaps import MASKED_RGB, VISIBLE_RGB

    figure, image = rendered("causal", ids="0,0,5,6")
    ax = figure.axes[0]
    # the band under keys 0-1, outside the cells (below y = 3.5)
    assert near(image, ax, 0.5, 3.62, (0.3, 0.3, 0.3), tolerance=60)
    assert not near(image, ax, 2.5, 3.62, (0.3, 0.3, 0.3), tolerance=60)
    # the cells themselves keep the mask colours: (3, 2) may attend, (2, 3) is masked
    for (x, y), colour in (((2, 3), VISIBLE_RGB), ((3, 2), MASKED_RGB)):
        px, py = ax.transData.transform((x - 0.25, y - 0.25))
        rgb = image[int(image.shape[0] - py), int(px), :3] * 255
        assert np.abs(rgb - np.array(colour)).max() <= 2
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert any(t.startswith("padding") for t in legend)


def _legend_texts(figure):
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def test_the_legend_names_the_diagonal_only_where_it_is_drawn():
    assert any(t.startswith("diagonal") for t in _legend_texts(mask_figure(build("window(3)", length=8))))
    long = mask_figure(build("window(100)", length=2000))  # pixels of 4 x 4 cells: no diagonal line on them
    assert not any(t.startswith("diagonal") for t in _legend_texts(long))


def test_inspect_names_the_file_and_its_convention_in_the_figure(tmp_path, monkeypatch):
    import torch
    from typer.testing import CliRunner

    import maskcli.render.heatmaps as heatmaps
    from maskcli.commands import app

    saved = []
    monkeypatch.setattr(heatmaps, "save_figure", lambda figure, path: saved.append(figure))
    keep = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    monkeypatch.chdir(tmp_path)
    torch.save(torch.zeros(6, 6).masked_fill(~keep, float("-inf")), "add.pt")
    result = CliRunner().invoke(app, ["inspect", "add.pt", "--png", "m.png"])
    assert result.exit_code == 0, result.output
    assert saved[0].get_suptitle().splitlines()[0] == "add.pt: additive mask, drawn as keep (it is causal)"


@pytest.mark.parametrize("length", [12, 2000])
def test_a_padding_band_stays_thin_and_clear_of_the_tick_labels(length):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = mask_figure(build("causal", length=length, lengths=f"{length * 3 // 4},{length}"))
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = figure.axes[0]
    bands = [patch.get_window_extent(renderer) for patch in ax.patches if patch.get_hatch()]
    below = [band for band in bands if band.y1 <= ax.get_window_extent(renderer).y0 + 1]  # along the keys
    assert below and all(band.height <= 8 * figure.dpi / 72 for band in below)  # about 6 points, whatever the size
    labels = [label.get_window_extent(renderer) for label in ax.get_xticklabels() if label.get_text()]
    assert labels and max(label.y1 for label in labels) < min(band.y0 for band in below)  # no label under the band


def _pixels(figure):
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    buffer.seek(0)
    return mpimg.imread(buffer)


def test_blocks_and_diff_figures_draw_the_label_boundaries():
    from maskcli.blockmask import layout
    from maskcli.diff import compare
    from maskcli.render.blocks import blocks_figure
    from maskcli.render.diff import diff_figure

    mask = build("document(sizes=[300,500,224])")
    figure = blocks_figure(layout(mask, 64, 64))
    image, ax = _pixels(figure), figure.axes[0]
    # positions on the axes: the documents start at keys 300 and 800 (and queries 300 and 800)
    for y in (150, 600, 950):
        assert near(image, ax, 300, y, MARK_RGB) and near(image, ax, 800, y, MARK_RGB)
        assert not near(image, ax, 550, y, MARK_RGB)
    assert near(image, ax, 150, 300, MARK_RGB) and near(image, ax, 950, 800, MARK_RGB)
    assert any(t.startswith("doc boundary") for t in _legend_texts(figure))
    figure = diff_figure(compare(build("document(0,0,0,1,1,1,1,1) & window(3)"), build("document(0,0,0,1,1,1,1,1)")))
    image, ax = _pixels(figure), figure.axes[0]
    # drawn on positions, each cell centred on its position (as a table's column k): key 3 starts at x = 2.5
    assert near(image, ax, 2.5, 1, MARK_RGB) and near(image, ax, 1, 2.5, MARK_RGB) and not near(image, ax, 5, 1, MARK_RGB)
    assert any(t.startswith("doc boundary") for t in _legend_texts(figure))
