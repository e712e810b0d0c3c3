"""Figures read back from disk: the colour at each cell centre is the mask's."""

from __future__ import annotations

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.cli import app
from maskcli.render.heatmaps import MASKED_RGB, VISIBLE_RGB

runner = CliRunner()


def panels(image: np.ndarray, q_len: int, k_len: int) -> list[tuple[int, int, int, int]]:
    """Bounding boxes (top, bottom, left, right) of the heatmap areas, left to right.

    A heatmap area is where the pixels are one of the two mask colours; the legend
    swatches are tiny, so only boxes big enough to hold the grid count.
    """
    rgb = (image[..., :3] * 255).round().astype(int)
    ours = np.zeros(rgb.shape[:2], dtype=bool)
    for colour in (VISIBLE_RGB, MASKED_RGB):
        ours |= (np.abs(rgb - np.array(colour)) <= 2).all(axis=-1)
    columns = ours.sum(axis=0) > 20
    # white cell-grid lines split a heatmap into strips: close gaps of a few pixels
    for j in range(1, len(columns) - 4):
        if not columns[j] and columns[j - 1] and columns[j + 1 : j + 5].any():
            columns[j] = True
    boxes, j = [], 0
    while j < len(columns):
        if columns[j]:
            start = j
            while j < len(columns) and columns[j]:
                j += 1
            rows = np.nonzero(ours[:, start:j].sum(axis=1) > (j - start) // 3)[0]
            if j - start > 4 * k_len:
                boxes.append((rows.min(), rows.max() + 1, start, j))
        j += 1
    return boxes


def cell_colours(image, box, q_len, k_len) -> np.ndarray:
    top, bottom, left, right = box
    rgb = (image[..., :3] * 255).round().astype(int)
    out = np.zeros((q_len, k_len), dtype=int)  # 1 visible, 0 masked, -1 neither
    for i in range(q_len):
        for j in range(k_len):
            y = int(top + (i + 0.5) * (bottom - top) / q_len)
            x = int(left + (j + 0.5) * (right - left) / k_len)
            pixel = rgb[y, x]
            out[i, j] = 1 if np.abs(pixel - VISIBLE_RGB).max() <= 2 else 0 if np.abs(pixel - MASKED_RGB).max() <= 2 else -1
    return out


def test_png_cells_show_the_mask(tmp_path):
    path = tmp_path / "causal.png"
    result = runner.invoke(app, ["show", "window", "--len", "7", "--window", "3", "--png", str(path)])
    assert result.exit_code == 0, result.output
    image = mpimg.imread(path)
    (box,) = panels(image, 7, 7)
    expected = np.array([[int(j <= i < j + 3) for j in range(7)] for i in range(7)])
    assert (cell_colours(image, box, 7, 7) == expected).all()


def test_one_panel_per_batch_row(tmp_path):
    path = tmp_path / "padding.png"
    result = runner.invoke(app, ["show", "causal", "--lengths", "5,3", "--png", str(path)])
    assert result.exit_code == 0, result.output
    image = mpimg.imread(path)
    boxes = panels(image, 5, 5)
    assert len(boxes) == 2
    for box, length in zip(boxes, (5, 3)):
        expected = np.array([[int(j <= i and j < length) for j in range(5)] for i in range(5)])
        assert (cell_colours(image, box, 5, 5) == expected).all()


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_svg_and_pdf(tmp_path, suffix, magic):
    path = tmp_path / f"m{suffix}"
    result = runner.invoke(app, ["show", "causal", "--len", "4", "--png", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes().startswith(magic)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import matplotlib.figure

    def broken(self, *args, **kwargs):
        with open(args[0], "wb") as handle:
            handle.write(b"half a figure")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    result = runner.invoke(app, ["show", "causal", "--len", "4", "--png", str(tmp_path / "m.png")])
    assert result.exit_code == 2, result.output
    assert "No space left on device" in result.stderr and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_attend_figure_draws_masked_cells_grey(tmp_path):
    path = tmp_path / "stages.png"
    result = runner.invoke(app, ["attend", "causal", "--len", "4", "--stages", "masked,weights", "--png", str(path)])
    assert result.exit_code == 0, result.output
    rgb = (mpimg.imread(path)[..., :3] * 255).round().astype(int)
    grey = (np.abs(rgb - np.array(MASKED_RGB)) <= 2).all(axis=-1)
    # two panels, each with 6 of 16 cells masked: a clear share of the image is that grey
    assert grey.sum() > 0.02 * grey.size
    keep = torch.ones(4, 4).tril().bool()
    assert int((~keep).sum()) == 6
