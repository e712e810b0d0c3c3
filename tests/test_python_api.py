"""maskcli.build() from Python values, and the views of what it returns (repr, table, figure, summary, why, diff, blocks,
notebook display); cells against double loops and torch's own matrices written here."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import definitions as ref
import maskcli
from maskcli.commands import app
from maskcli.errors import MaskError

DOCS = Path(__file__).resolve().parent.parent / "docs"


def keep(mask) -> np.ndarray:
    return np.broadcast_to(mask.dense()[:, 0], (mask.batch, *mask.shape[2:]))


def reference(tree, n, valid=None, batch=1, left=None):
    return np.array(ref.dense(tree, q0=0, lq=n, k0=0, lk=n, batch=batch, valid=valid, ids_valid_left_pad=left))


@pytest.mark.parametrize("convert", [list, np.array, torch.tensor], ids=["list", "numpy", "torch"])
def test_lengths_ids_and_labels_take_python_values(convert):
    labels = [0, 0, 1, 1, 1, 2]
    doc = maskcli.build("document", chunks=convert(labels), lengths=convert([6, 4]))
    valid = [[kv < 6 for kv in range(6)], [kv < 4 for kv in range(6)]]
    assert np.array_equal(keep(doc), reference(("kind", "document", {"labels": [labels]}), 6, valid, 2))
    assert doc.text == "document(0,0,1,1,1,2)" and doc.padding_text == "lengths 6,4"

    ids = [[0, 0, 5, 6, 7, 8], [5, 6, 7, 8, 9, 1]]
    local = maskcli.build("local", chunk_size=2, ids=convert(ids))
    valid = [[token != 0 for token in row] for row in ids]
    assert np.array_equal(keep(local), reference(("kind", "local", {"chunk_size": 2}), 6, valid, 2, [2, 0]))

    blocks = maskcli.build("causal | blocks", block_ids=convert([-1, 0, 0, 0, -1, -1]))
    expected = reference(("or", [("kind", "causal", {}), ("kind", "blocks", {"labels": [[-1, 0, 0, 0, -1, -1]]})]), 6)
    assert np.array_equal(keep(blocks), expected)

    tree = maskcli.build("tree", parents=convert([-1, 0, 0, 1]), offset=3)
    assert np.array_equal(keep(tree)[0], np.array(ref.dense(("kind", "tree", {"parents": [-1, 0, 0, 1]}), q0=3, lq=4, k0=0, lk=7)[0]))


def test_sizes_rows_may_differ_and_values_equal_the_command_lines_text():
    python = maskcli.build("segment & window", sizes=[[2, 3], [1, 1, 3]], window=np.int64(2))
    text = maskcli.build("segment & window", maskcli.MaskOptions(params={"--sizes": "2,3;1,1,3", "--window": 2}))
    assert python.text == text.text == "segment(sizes=[2,3;1,1,3]) & window(2)"
    assert np.array_equal(python.dense(), text.dense())
    docs = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    assert maskcli.build("document(0,0,0,1,1,1,1,1) & local", chunk_size=2).text == maskcli.build(
        "local", chunk_size=2, documents=docs).text.replace("local(2, documents=[0,0,0,1,1,1,1,1])", "document(0,0,0,1,1,1,1,1) & local(2)")
    words = maskcli.build("causal", tokens=["Your", "journey", "starts"])
    assert words.tokens == ("Your", "journey", "starts") and words.shape == (1, 1, 3, 3)


def test_bad_python_values_are_one_line_errors_and_unknown_keywords_a_type_error():
    with pytest.raises(MaskError, match=r"^lengths=: give integers, as a list, a list of rows"):
        maskcli.build("causal", lengths=["a", "b"])
    with pytest.raises(MaskError, match=r"^chunks=: give integers"):
        maskcli.build("chunk", chunks=[[0, 1], [0]])
    with pytest.raises(MaskError, match=r"window\(0\)|--window 0"):
        maskcli.build("window", window=0)
    with pytest.raises(TypeError, match=r"build\(\) got an unexpected keyword 'windw': give a MaskOptions field"):
        maskcli.build("window", windw=3)


def test_repr_is_one_line():
    assert repr(maskcli.build("document(sizes=[300,212]) & window(128)")) == (
        "Mask('document(sizes=[300,212]) & window(128)', shape=(1, 1, 512, 512))")
    assert repr(maskcli.build("causal", lengths=[5, 3], offset=2, length=3)) == (
        "Mask('causal', shape=(2, 1, 3, 5), positions='queries 2-4 · keys 0-4', padding='lengths 5,3')")
    long = repr(maskcli.build("document", chunks=np.repeat(np.arange(400), 3)))
    assert "\n" not in long and len(long) < 200


def text_of(renderable, width=120) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_table_and_summary_are_what_the_terminal_prints(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    m = maskcli.build("document(0,0,0,1,1,1) & window(2)", lengths=[6, 5])
    shown = CliRunner().invoke(app, ["show", "document(0,0,0,1,1,1) & window(2)", "--lengths", "6,5"]).stdout
    assert text_of(m.table()).split() == shown.split()
    summary = CliRunner().invoke(app, ["show", "document(0,0,0,1,1,1) & window(2)", "--lengths", "6,5", "--summary"]).stdout
    assert repr(m.summary()).split() == summary.split()
    expected = reference(("and", [("kind", "document", {"labels": [[0, 0, 0, 1, 1, 1]]}), ("kind", "window", {"window": 2})]), 6,
                         [[True] * 6, [True] * 5 + [False]], 2)
    assert m.summary().visible == int(expected.sum())


def test_why_keep_is_a_bool_for_one_cell_and_a_list_per_batch_row_otherwise():
    padded = maskcli.build("causal", length=4, lengths=[4, 2])  # row 1's keys 2-3 are padding
    assert padded.why(3, 3).keep == [True, False]
    assert padded.why(3, 3, b=1).keep is False and padded.why(3, 1, b=1).keep is True


def test_table_is_sized_for_the_terminal_as_show_is(monkeypatch):
    import io

    from rich.console import Console

    for columns in (60, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        long = maskcli.build("causal & (window(1020) | sink(4))", length=4096)
        console = Console(width=columns, file=io.StringIO(), color_system=None)
        console.print(long.table())
        lines = console.file.getvalue().rstrip("\n").splitlines()
        shown = CliRunner().invoke(app, ["show", "causal & (window(1020) | sink(4))", "--len", "4096"], env={"COLUMNS": str(columns)})
        assert [line.rstrip() for line in lines] == shown.stdout.rstrip("\n").splitlines()
        assert max(len(line.rstrip()) for line in lines) <= columns
    assert len(maskcli.build("causal", length=4096).table(width=80).renderables) > 0


def test_why_diff_and_blocks_against_the_cells():
    a = maskcli.build("causal & window(3)", length=12)
    b = maskcli.build("causal", length=12)
    tril = torch.tril(torch.ones(12, 12, dtype=torch.bool)).numpy()
    band = tril & ~torch.tril(torch.ones(12, 12, dtype=torch.bool), diagonal=-3).numpy()
    assert a.why(5, 2).keep is False and a.why(5, 3).keep is True  # one cell asked: a bool
    assert "window(3): 5 - 2 = 3 >= 3 -> masked" in repr(a.why(5, 2))
    assert a.why(5, 3).json()["why"][0]["keep"] is True
    d = a.diff(b)
    assert (d.equal, d.only_a, d.only_b, d.both) == (False, 0, int((tril & ~band).sum()), int(band.sum()))
    assert repr(d) == f"Difference('causal & window(3)', 'causal': only A allows 0 cells, only B {int((tril & ~band).sum())})"
    blocks = a.blocks(4)
    cells = band.reshape(3, 4, 3, 4).transpose(0, 2, 1, 3).reshape(3, 3, 16)
    full, partial = int(cells.all(-1).sum()), int((cells.any(-1) & ~cells.all(-1)).sum())
    assert blocks.counts(0) == (full, partial, 9 - full - partial)
    assert "block=(4, 4)" in repr(blocks) and "blocks of causal &amp; window(3)" in blocks._repr_html_()


def test_figure_is_a_matplotlib_figure_of_the_cells():
    import matplotlib

    matplotlib.use("Agg")
    figure = maskcli.build("causal", length=4).figure()
    assert type(figure).__name__ == "Figure"
    figure.canvas.draw()
    assert figure.axes and any("causal" in (ax.get_title() + (figure._suptitle.get_text() if figure._suptitle else "")) for ax in figure.axes)


def test_notebook_display_is_the_terminals_view_in_html():
    import html as escapes
    import re

    m = maskcli.build("document(0,0,1,1)", lengths=[4, 3])
    small = m._repr_html_()
    assert small.startswith("<pre") and "<script" not in small
    assert escapes.unescape(re.sub(r"<[^>]+>", "", small)).split() == text_of(m.table()).split()
    expected = reference(("kind", "document", {"labels": [[0, 0, 1, 1]]}), 4, [[True] * 4, [True] * 3 + [False]], 2)
    kept = re.findall(r'<span style="color: #008000[^"]*">1</span>', small)  # the green 1s: the cells that may attend
    assert len(kept) == int(expected.sum())
    large = maskcli.build("causal", length=4096)._repr_html_()
    assert "exact" in large and len(large) < 200_000  # a density map, not 16M cells
    diff = maskcli.build("causal", length=4).diff(maskcli.build("full", length=4))._repr_html_()
    assert "only A allows 0 cells · only B allows 6" in diff


def test_import_and_build_stay_light():
    code = (
        "import sys, maskcli\n"
        "m = maskcli.build('document', sizes=[3, 2], lengths=[5, 4]); repr(m); m.dense(); m.why(4, 2)\n"
        "print(sorted(name for name in ('torch', 'matplotlib', 'rich', 'typer') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e .[test])")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e .[test])")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e .[test])")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(DOCS.parent), os.environ.get("PYTHONPATH")])))  # this maskcli
    notebook = nbformat.read(DOCS / "notebook.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(DOCS)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    html = [output["data"]["text/html"] for output in outputs if "text/html" in output.get("data", {})]
    assert any("document(sizes=[3,5]) &amp; window(2)" in page or "document(sizes=[3,5]) & window(2)" in page for page in html)
    shown = json.dumps([output.get("data", {}).get("text/plain", "") for output in outputs])
    assert "Mask(" in shown


@pytest.mark.parametrize("given", [{"offset": 1.5}, {"offset": float("nan")}, {"offset": __import__("decimal").Decimal("2")},
                                   {"heads": 2.0}, {"length": 3.0}, {"kv_start": True}, {"pad_id": 1.5}])
def test_positions_and_head_counts_are_whole_numbers_or_a_mask_error(given):
    """offset=1.5 made a mask of keys 0-4.5 and heads=nan a shape (1, nan, 4, 4): now one MaskError naming the value."""
    (name, value), = given.items()
    with pytest.raises(MaskError, match=re.escape(f"build(): {name}={value!r} is a {type(value).__name__}; {name} is a whole number")):
        maskcli.build("causal", **({"length": 4} | given))
    assert maskcli.build("causal", length=4, offset=np.int64(2)).shape == (1, 1, 4, 6)  # numpy integers are whole


@pytest.mark.parametrize("apis, says", [("bogus", "'bogus' is not one that maskcli records"), (["sdpa", "x"], "'x' is not one"),
                                        ([], "no API is one"), (5, "give a list of API names")])
def test_trace_refuses_apis_it_does_not_record(apis, says):
    from maskcli.trace.capture import Trace  # (the class behind it, made directly, refuses them the same way)

    for make in (maskcli.trace, Trace):
        with pytest.raises(MaskError, match=says):
            make(apis=apis)
    assert maskcli.trace(apis="sdpa, mha").apis == ("sdpa", "mha")  # a string is comma-separated names, not letters


@pytest.mark.parametrize("options", [{"length": 1.5}, {"length": 4, "heads": float("nan")},
                                     {"length": 4, "offset": __import__("decimal").Decimal("1.5")}, {"length": 4, "kv_len": "4"}])
def test_mask_options_given_directly_are_whole_numbers_too(options):
    """build(options=MaskOptions(length=1.5)) went past build()'s own check: a shape (1, 1, 1.5, 1.5), keys 0-4.5."""
    name = next(name for name, value in options.items() if type(value) is not int)
    with pytest.raises(MaskError, match=re.escape(f"{name}={options[name]!r} is a {type(options[name]).__name__}")):
        maskcli.build("causal", options=maskcli.MaskOptions(**options))


def test_rows_and_keys_take_tuples_as_crop_does():
    """build(rows=(1, 3)) was "unexpected AttributeError: 'tuple' object has no attribute 'split'"."""
    viewed = maskcli.build("causal", length=4, rows=(1, 3), keys=(None, 2))
    assert viewed.dense()[0, 0].tolist() == [[q >= kv for kv in range(2)] for q in range(1, 3)]
    assert viewed.dense().tolist() == maskcli.build("causal", length=4, rows="1:3", keys=":2").dense().tolist()
    for bad in [(1.5, 3), (1,), (True, 2)]:
        with pytest.raises(MaskError, match=re.escape(f"rows={bad!r}: give (A, B), whole numbers or None")):
            maskcli.build("causal", length=4, rows=bad)
    with pytest.raises(MaskError, match=re.escape("--rows (1.5, 3): give (A, B), whole numbers")):
        maskcli.build("causal", length=4).crop((1.5, 3))  # was a shape (1, 1, 1.5, 4)


@pytest.mark.parametrize("value", [[True, 3], [[1, False]], np.array([True, False])])
def test_bools_are_no_counts_or_labels(value):
    """numpy reads [True, 3] as [1, 3]: sizes=[True, 3] was document(sizes=[1,3]), lengths=[True, 2] 'lengths 1,2'."""
    for given in ({"sizes": value}, {"lengths": value}):
        with pytest.raises(MaskError, match="holds True/False: give integers"):
            maskcli.build("document" if "sizes" in given else "causal", length=4, **given)


def test_views_refuse_what_they_cannot_show_in_one_line():
    """Each was an internal error (ZeroDivisionError, KeyError, AttributeError) or a table for width -5."""
    mask = maskcli.build("causal", length=4)
    for call, says in [(lambda: mask.blocks(0), "blocks(): block=0: give a block size"),
                       (lambda: mask.blocks((2, 0)), "blocks(): block=(2, 0)"),
                       (lambda: mask.blocks(1.5), "blocks(): block=1.5"),
                       (lambda: mask.summary(grid=(0, 0)), r"summary\(\): grid=\(0, 0\)"),
                       (lambda: mask.table(convention="bogus"), "table(): unknown convention 'bogus'"),
                       (lambda: mask.table(convention="additive", dtype="int8"), "table(): unknown dtype 'int8'"),
                       (lambda: mask.table(width=-5), "width=-5: give the columns to fit"),
                       (lambda: mask.cells(1.5), "cells(b=1.5, h=0, q_lo=0, q_hi=4): give whole numbers"),
                       (lambda: mask.cells(0, 0, -1), "q_lo=-1")]:
        with pytest.raises(MaskError, match=says if "\\" in says else re.escape(says)):
            call()
    with pytest.raises(TypeError, match="diff\\(\\) compares with another Mask"):
        mask.diff(3)
    blocks = mask.blocks((2,))  # one size in a tuple: square blocks, as blocks(2)
    assert (blocks.q_block, blocks.kv_block) == (2, 2) and blocks.full_kv_num_blocks[0, 0].tolist() == [0, 1]
    assert mask.summary(grid=(2, 2)).visible == sum(q + 1 for q in range(4))  # query q of a causal mask sees q+1 keys
