"""`maskcli show` and `maskcli chunk` through Typer's CliRunner; expected text and matrices written here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import definitions as ref
from maskcli import memory
from maskcli.commands import app
from strategies import cases, expected_cells

runner = CliRunner()


def invoke(args, **kwargs):
    return runner.invoke(app, [str(arg) for arg in args], **kwargs)


def ok(args, **kwargs):
    result = invoke(args, **kwargs)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result


def lines(text):
    """Non-empty lines, white space collapsed."""
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


MARKS = {"│", "║", "┼", "pad"}


def table_rows(text):
    """The body rows of every table in the output (lines that start with a query position), cells only:
    the structure marks (label line above the keys, label column, rules, padding tags) taken out;
    test_structure_marks_in_tables checks those."""
    out, tagged = [], False
    all_lines = lines(text)
    for i, line in enumerate(all_lines):
        if line.startswith("q \\ kv"):
            tagged = len(line.split()) > 3 and line.split()[3] in ("doc", "chunk", "seg", "block")
            continue
        if i + 1 < len(all_lines) and all_lines[i + 1].startswith("q \\ kv"):
            continue  # the labels above the key positions
        if set(line.split()) <= {"─", "┼"} or not re.match(r"-?\d+ ", line) or "one character" in line:
            continue
        words = [word for word in line.split() if word not in MARKS]
        if tagged:
            del words[1]
        out.append(" ".join(words))
    return out


# --- the table ----------------------------------------------------------------------


def test_show_causal_len_6_is_the_lower_triangular_table():
    result = ok(["show", "causal", "--len", "6"])
    assert lines(result.stdout) == [
        "causal · shape (B=1, H=1, Lq=6, Lk=6)",
        "convention: keep (bool, 1 = True = may attend, 0 = masked)",
        "q \\ kv 0 1 2 3 4 5",
        "0 1 0 0 0 0 0",
        "1 1 1 0 0 0 0",
        "2 1 1 1 0 0 0",
        "3 1 1 1 1 0 0",
        "4 1 1 1 1 1 0",
        "5 1 1 1 1 1 1",
    ]
    assert result.stderr == ""


def test_an_expression_is_named_by_its_canonical_text():
    result = ok(["show", "document(0,0,0,1,1,1)&window( 2 )"])
    assert lines(result.stdout)[0] == "document(0,0,0,1,1,1) & window(2) · shape (B=1, H=1, Lq=6, Lk=6)"
    assert table_rows(result.stdout) == [
        "0 1 0 0 0 0 0", "1 1 1 0 0 0 0", "2 0 1 1 0 0 0", "3 0 0 0 1 0 0", "4 0 0 0 1 1 0", "5 0 0 0 0 1 1",
    ]


def test_gemma_image_tokens_and_streaming_sinks():
    gemma = ok(["show", "causal | blocks(-1,-1,0,0,0,-1)"])
    assert table_rows(gemma.stdout) == [
        "0 1 0 0 0 0 0", "1 1 1 0 0 0 0", "2 1 1 1 1 1 0", "3 1 1 1 1 1 0", "4 1 1 1 1 1 0", "5 1 1 1 1 1 1",
    ]
    sinks = ok(["show", "causal & (window(3) | sink(1))", "--len", "6"])
    assert table_rows(sinks.stdout)[-2:] == ["4 1 0 1 1 1 0", "5 1 0 0 1 1 1"]


def test_chunk_table_is_the_tutorial_mask():
    result = ok(["chunk", "0,0,1,1,2"])
    assert lines(result.stdout)[0] == "chunk(0,0,1,1,2) · shape (B=1, H=1, Lq=5, Lk=5)"
    assert table_rows(result.stdout) == ["0 1 1 0 0 0", "1 1 1 0 0 0", "2 1 1 1 1 0", "3 1 1 1 1 0", "4 1 1 1 1 1"]


def test_prefill_rows_are_absolute_query_positions():
    result = ok(["show", "prefill", "--offset", "4", "--len", "2"])
    assert lines(result.stdout)[0] == "causal · shape (B=1, H=1, Lq=2, Lk=6) · queries 4-5 · keys 0-5"
    assert table_rows(result.stdout) == ["4 1 1 1 1 1 0", "5 1 1 1 1 1 1"]


def test_a_sliding_cache_labels_its_key_columns_by_absolute_position():
    result = ok(["show", "window", "--window", "3", "--offset", "9", "--len", "1", "--kv-start", "6"])
    assert lines(result.stdout)[0] == "window(3) · shape (B=1, H=1, Lq=1, Lk=4) · queries 9 · keys 6-9"
    assert "q \\ kv 6 7 8 ║ 9" in lines(result.stdout)  # keys 6-8 are in the cache, 9 is the new one
    assert table_rows(result.stdout) == ["9 0 1 1 1"]


def test_a_static_cache_aligns_top_left_unless_told_otherwise():
    top = ok(["show", "causal", "--len", "2", "--kv-len", "4"])
    assert table_rows(top.stdout) == ["0 1 0 0 0", "1 1 1 0 0"]
    bottom = ok(["show", "causal", "--len", "2", "--kv-len", "4", "--align", "bottom-right"])
    assert table_rows(bottom.stdout) == ["2 1 1 1 0", "3 1 1 1 1"]


def test_padding_prints_one_table_per_batch_row():
    result = ok(["show", "padding", "--lengths", "4,2"])
    out = lines(result.stdout)
    assert out[0] == "padding · lengths 4,2 · shape (B=2, H=1, Lq=4, Lk=4)"
    assert "batch 0 (length 4)" in out and "batch 1 (length 2)" in out
    assert table_rows(result.stdout) == ["0 1 1 1 1", "1 1 1 1 1", "2 1 1 1 1", "3 1 1 1 1", "0 1 1 0 0", "1 1 1 0 0", "2 1 1 0 0", "3 1 1 0 0"]


def test_padding_from_ids():
    result = ok(["show", "padding", "--ids", "5,6,0;7,0,0", "--pad-id", "0"])
    assert table_rows(result.stdout) == ["0 1 1 0", "1 1 1 0", "2 1 1 0", "0 1 0 0", "1 1 0 0", "2 1 0 0"]


@pytest.mark.parametrize("convention, dtype, visible, masked, described", [
    ("keep", "float32", "1", "0", "keep (bool, 1 = True = may attend, 0 = masked)"),
    ("block", "float32", "0", "1", "block (bool, 1 = True = masked, 0 = may attend)"),
    ("additive", "float32", "0", "-inf", "additive float32 (0 = may attend, -inf = masked)"),
    ("min", "float32", "0", "-3.4e+38", "min float32 (0 = may attend, -3.4e+38 = masked)"),
    ("min", "float16", "0", "-65504", "min float16 (0 = may attend, -65504 = masked)"),
    ("min", "bfloat16", "0", "-3.4e+38", "min bfloat16 (0 = may attend, -3.4e+38 = masked)"),
    ("int", "float32", "1", "0", "int (1 = may attend, 0 = masked)"),
])
def test_as_shows_each_conventions_symbols(convention, dtype, visible, masked, described):
    args = ["show", "causal", "--len", "3", "--as", convention] + (["--dtype", dtype] if convention in ("additive", "min") else [])
    result = ok(args)
    assert lines(result.stdout)[1] == f"convention: {described}"
    v, m = visible, masked
    assert table_rows(result.stdout) == [f"0 {v} {m} {m}", f"1 {v} {v} {m}", f"2 {v} {v} {v}"]


def test_tokens_label_both_axes_by_absolute_position():
    result = ok(["show", "causal", "--len", "3", "--tokens", "Your journey starts"])
    assert "q \\ kv Your journey starts" in lines(result.stdout)
    assert table_rows(result.stdout) == ["0 Your 1 0 0", "1 journey 1 1 0", "2 starts 1 1 1"]
    prefill = ok(["show", "prefill", "--offset", "2", "--len", "2", "--tokens", "a b c d"])
    assert "q \\ kv a b ║ c d" in lines(prefill.stdout)  # a and b are in the cache
    assert table_rows(prefill.stdout) == ["2 c 1 1 1 0", "3 d 1 1 1 1"]


def test_heads_are_shown_once_when_identical():
    result = ok(["show", "causal", "--len", "2", "--heads", "3"])
    assert "(B=1, H=3, Lq=2, Lk=2)" in result.stdout
    assert table_rows(result.stdout) == ["0 1 0", "1 1 1"]


def test_labels_that_go_down_warn_on_stderr_and_still_show_the_mask():
    result = invoke(["chunk", "0,1,0"])
    assert result.exit_code == 0, result.output
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("maskcli: warning: chunk(0,1,0): chunk labels go down at position 2 (1 then 0)")
    labels = [0, 1, 0]
    assert table_rows(result.stdout) == [f"{q} " + " ".join(str(int(labels[kv] <= labels[q])) for kv in range(3)) for q in range(3)]
    assert ok(["show", "document", "--chunks", "1,1,0"]).stderr == ""


def test_one_row_of_labels_per_batch_row():
    result = ok(["chunk", "0,0,1;0,1,1"])
    assert "(B=2, H=1, Lq=3, Lk=3)" in result.stdout
    assert table_rows(result.stdout) == ["0 1 1 0", "1 1 1 0", "2 1 1 1", "0 1 0 0", "1 1 1 1", "2 1 1 1"]


# --- exact density maps for wide masks ------------------------------------------------------


DENSITY = {"█": lambda s: s == 1, "·": lambda s: s == 0, "▓": lambda s: 0.5 < s < 1, "░": lambda s: 0 < s <= 0.5}


def map_of(stdout):
    """(rows per character, keys per character, [(label, characters)]) of the first map."""
    text = " ".join(stdout.split())
    found = re.search(r"one character = ([\d,]+) quer(?:y|ies) x ([\d,]+) keys?", text)
    rows, cols = (int(found[i].replace(",", "")) for i in (1, 2))
    body = [[line.split()[0].rstrip("─"), line.split()[-1]] for line in stdout.splitlines() if MAP_ROW.fullmatch(line)]
    return rows, cols, body


MAP_ROW = re.compile(r"\s*\d+─? +[█▓░·]+")  # a label, ─ where a label boundary starts in its rows, the characters


@pytest.mark.parametrize("args, tree, q_len, offset", [
    (["show", "causal", "--len", "300"], ("kind", "causal", {}), 300, 0),
    (["show", "window", "--len", "300", "--window", "40"], ("kind", "window", {"window": 40}), 300, 0),
    (["show", "prefill", "--offset", "100", "--len", "200"], ("kind", "causal", {}), 200, 100),
    (["show", "prefix(90)", "--len", "250"], ("kind", "prefix", {"prefix": 90}), 250, 0),
    (["show", "window(3) | sink(2)", "--len", "500"], ("or", [("kind", "window", {"window": 3}), ("kind", "sink", {"sink": 2})]), 500, 0),
])
def test_wide_mask_is_an_exact_density_map(args, tree, q_len, offset):
    result = ok(args, env={"COLUMNS": "80"})
    text = " ".join(result.stdout.split())
    assert "exact, from key intervals" in text and "█ all visible ▓ over half ░ some · none" in text
    assert all(len(line) <= 80 for line in result.stdout.splitlines())
    rows, cols, body = map_of(result.stdout)
    k_len = q_len + offset
    keep = ref.dense(tree, q0=offset, lq=q_len, k0=0, lk=k_len)[0]
    check_ruler(result.stdout, cols)
    assert len(body) == -(-q_len // rows)
    for r, (label, chars) in enumerate(body):
        assert int(label) == offset + r * rows  # labelled by the block's first absolute query position
        assert len(chars) == -(-k_len // cols)
        for c, char in enumerate(chars):
            block = [keep[i][j] for i in range(r * rows, min(q_len, (r + 1) * rows)) for j in range(c * cols, min(k_len, (c + 1) * cols))]
            assert DENSITY[char](sum(block) / len(block)), (r, c, char)


def check_ruler(stdout, cols, first_key=0):
    """Every number on the key ruler stands over the column whose first key it names, apart from its neighbours."""
    out = stdout.splitlines()
    first = next(i for i, line in enumerate(out) if MAP_ROW.fullmatch(line))
    start = len(out[first]) - len(out[first].split()[-1])  # where the map's cells begin
    ruler = out[first - 1] if re.search(r"\d", out[first - 1]) else out[first - 2]  # above the line of boundaries, if any
    marks = list(re.finditer(r"\d+", ruler))
    assert marks and int(marks[0][0]) == first_key and marks[0].start() == start
    for mark in marks:
        assert int(mark[0]) == first_key + (mark.start() - start) * cols, ruler
    assert all(b.start() > a.end() for a, b in zip(marks, marks[1:]))


def test_a_million_token_window_shows_its_band_in_60_columns():
    result = ok(["show", "window", "--len", "1048576", "--window", "128"], env={"COLUMNS": "60"})
    rows, cols, body = map_of(result.stdout)
    assert all(len(line) <= 60 for line in result.stdout.splitlines())
    assert "exact, from key intervals" in " ".join(result.stdout.split())
    for r, (_, chars) in enumerate(body):
        diagonal = [chars[c] for c in range(len(chars)) if c * cols <= (r + 1) * rows - 1 and (c + 1) * cols > r * rows]
        assert diagonal and all(char != "·" for char in diagonal), r  # the band is visible in every row of the map
        assert set(chars) - set(diagonal) <= {"·"}
    check_ruler(result.stdout, cols)


def test_a_sliding_cache_map_starts_its_ruler_at_the_first_key():
    result = ok(["show", "window(100)", "--len", "400", "--offset", "1000", "--kv-start", "900"], env={"COLUMNS": "80"})
    _, cols, _ = map_of(result.stdout)
    check_ruler(result.stdout, cols, first_key=900)


def test_labels_that_go_down_are_counted_cell_by_cell_and_say_so():
    labels = ",".join(str(v) for v in [0, 2, 1] * 100)
    result = ok(["chunk", labels], env={"COLUMNS": "80"})
    assert "exact, cell by cell (chunk labels go down at position 2 (2 then 1))" in " ".join(result.stdout.split())


def test_a_length_past_what_intervals_fit_is_refused_with_the_memory_it_needs():
    result = invoke(["show", "causal", "--len", 1 << 40], env={"COLUMNS": "80"})
    assert result.exit_code == 2 and "for its key intervals" in result.stderr and result.stdout == ""


def test_density_map_per_batch_row():
    result = ok(["show", "causal", "--len", "300", "--lengths", "300,100"], env={"COLUMNS": "80"})
    assert result.stdout.count("one character =") == 2
    assert "batch 0 (length 300)" in result.stdout and "batch 1 (length 100)" in result.stdout


# --- JSON equals the definitions ------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), heads=st.integers(1, 2), shown_as=st.sampled_from(["keep", "block", "int"]))
def test_json_of_random_expressions_equals_the_definitions(case, heads, shown_as):
    tree, options, frame, valid = case
    args = ["show", ref.text(tree), "--heads", heads, "--as", shown_as, "--json"]  # --json writes the --as convention
    flags = {"length": "--len", "offset": "--offset", "kv_start": "--kv-start", "kv_len": "--kv-len", "align": "--align",
             "lengths": "--lengths", "ids": "--ids"}
    for key, flag in flags.items():
        if options.get(key) is not None:
            args += [flag, options[key]]
    got = json.loads(ok(args).stdout)
    batch = got["shape"][0]
    expected = expected_cells(tree, options, frame, valid, batch)
    assert got["shape"] == [batch, heads, frame[1], frame[3]]
    assert (got["q_offset"], got["kv_offset"], got["convention"]) == (frame[0], frame[2], shown_as)
    cells = np.array(got["mask"], dtype=object)
    keep = {"block": cells == 0, "additive": cells == 0.0, "min": cells == 0.0}.get(shown_as, cells == 1)
    assert np.array_equal(keep.astype(bool), np.repeat(expected[:, None], heads, axis=1))


def test_json_names_the_expression_its_kinds_and_their_params():
    got = json.loads(ok(["show", "document(sizes=[2,2]) & window(3)", "--lengths", "4,3", "--json"]).stdout)
    assert got["expression"] == "document(sizes=[2,2]) & window(3)"
    assert got["kind"] is None and got["params"] == {}
    assert got["kinds"] == [{"kind": "document", "params": {"labels": [0, 0, 1, 1]}}, {"kind": "window", "params": {"window": 3}}]
    assert got["lengths"] == [4, 3] and got["name"] == "document_sizes_2_2_and_window_3"
    single = json.loads(ok(["show", "window", "--window", "2", "--len", "3", "--json"]).stdout)
    assert (single["kind"], single["params"], single["expression"]) == ("window", {"window": 2}, "window(2)")
    prefill = json.loads(ok(["show", "prefill", "--offset", "4", "--len", "2", "--json"]).stdout)
    assert (prefill["q_offset"], prefill["kv_offset"], prefill["shape"]) == (4, 0, [1, 1, 2, 6])


def test_chunk_json_is_the_tutorial_matrix():
    got = json.loads(ok(["chunk", "0,0,1,1,1,1,2,2,2,3,4,4", "--json"]).stdout)
    assert got["kind"] == "chunk" and got["convention"] == "keep" and got["q_offset"] == 0
    assert got["params"] == {"labels": [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4]}
    labels = [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4]
    assert got["mask"] == [[[[int(labels[kv] <= labels[q]) for kv in range(12)] for q in range(12)]]]


def test_json_is_one_object_and_carries_tokens():
    result = ok(["show", "causal", "--len", "2", "--tokens", "hello world", "--json"])
    got = json.loads(result.stdout)  # nothing but the object on stdout
    assert got["tokens"] == ["hello", "world"] and got["mask"] == [[[[1, 0], [1, 1]]]]


def test_one_lengths_or_ids_row_serves_every_label_row_and_is_named_in_each_title():
    result = ok(["show", "document(0,0,1,1;0,1,1,1)", "--lengths", "3"])
    assert "batch 0 (length 3)" in result.stdout and "batch 1 (length 3)" in result.stdout
    assert "batch 1 (length 3): visible 6 of 16" in ok(["show", "document(0,0,1,1;0,1,1,1)", "--lengths", "3", "--summary"]).stdout
    assert "batch 1 (ids 1,2,3,0)" in ok(["show", "document(0,0,1,1;0,1,1,1)", "--ids", "1,2,3,0"]).stdout


def test_a_billion_identical_heads_are_one_panel_at_once():
    from bounded import MIB, builds_under

    with builds_under(64 * MIB):  # no list of a billion heads
        result = ok(["show", "causal", "--len", "4", "--heads", str(10**9)])
    assert "heads 0-999999999 (identical)" in result.stdout and result.stdout.rstrip().endswith(" 3       1  1  1  1")


def test_tokens_are_shown_as_written_never_as_markup_or_maths(tmp_path):
    words = "[/] [red]x[/red] $\\frac$"
    result = ok(["show", "causal", "--tokens", words, "--png", str(tmp_path / "m.png")])
    lines = result.stdout.splitlines()
    assert lines[2].split() == ["q", "\\", "kv", "[/]", "[red]x[/red]", "$\\frac$"] and lines[5].split()[:2] == ["2", "$\\frac$"]
    assert (tmp_path / "m.png").stat().st_size > 0
    attend = runner.invoke(app, ["attend", "causal", "--tokens", words, "--stages", "weights", "--png", str(tmp_path / "a.png")])
    assert attend.exit_code == 0 and "[red]x[/red]" in attend.stdout, attend.output


def test_every_batch_rows_table_starts_its_columns_at_the_same_place():
    lines = ok(["show", "padding", "--lengths", "4,2"]).stdout.splitlines()
    headers = [line for line in lines if line.startswith(" q \\ kv")]
    assert headers == [" q \\ kv       0  1  2  3"] * 2  # batch 0 has no padding, yet keeps the tag column
    assert " 0            1  1  1  1" in lines and " 2       pad  1  1  0  0" in lines


def test_many_batch_rows_show_the_first_panels_and_say_what_is_left_out(tmp_path):
    from maskcli.mask import build
    from maskcli.render.masks import mask_figure

    lengths = ",".join(str(i % 3 + 1) for i in range(100))
    result = ok(["show", "causal", "--lengths", lengths])
    assert result.stdout.count("\nbatch ") == 24 and "batch 23 (length 3)" in result.stdout and "batch 24" not in result.stdout
    assert result.stdout.rstrip().endswith(
        "24 panels shown; batch rows 24-99 not shown: --summary counts every one, --json or --save has every cell"
    )
    assert "batch 99 (length 1): visible 3 of 9" in ok(["show", "causal", "--lengths", lengths, "--summary"]).stdout
    figure = mask_figure(build("causal", lengths=lengths))
    assert len([ax for ax in figure.axes if ax.get_images()]) == 8
    assert figure.get_suptitle().endswith("8 panels shown; batch rows 8-99 not shown")


# --- saved tensors and figures named after the mask ---------------------------------------------


def expected_tensor_values(convention, dtype):
    """causal --len 4 --lengths 4,2 in `convention`, from the definition."""
    keep = ref.dense(("kind", "causal", {}), q0=0, lq=4, k0=0, lk=4, batch=2, valid=[[True] * 4, [True, True, False, False]])
    fill = {"additive": -math.inf, "min": float(torch.finfo(dtype).min) if dtype.is_floating_point else None}.get(convention)

    def cell(k):
        return {"keep": k, "block": not k, "int": int(k)}.get(convention, 0.0 if k else fill)

    return [[[cell(k) for k in row] for row in plane] for plane in keep]


SAVES = [
    ("keep", "float32", torch.bool, np.bool_),
    ("block", "float32", torch.bool, np.bool_),
    ("int", "float32", torch.int64, np.int64),
    ("additive", "float32", torch.float32, np.float32),
    ("additive", "float16", torch.float16, np.float16),
    ("min", "float32", torch.float32, np.float32),
    ("min", "float16", torch.float16, np.float16),
    ("min", "bfloat16", torch.bfloat16, None),
]


@pytest.mark.parametrize("convention, dtype_name, torch_dtype, numpy_dtype", SAVES)
def test_save_pt_and_npy_round_trip_in_the_as_convention(tmp_path, convention, dtype_name, torch_dtype, numpy_dtype):
    base = ["show", "causal", "--len", "4", "--lengths", "4,2", "--as", convention]
    base += ["--dtype", dtype_name] if convention in ("additive", "min") else []
    want = expected_tensor_values(convention, torch_dtype)
    pt = tmp_path / "mask.pt"
    result = ok([*base, "--save", pt])
    assert f"wrote {pt} ({convention} convention)" in result.stderr
    saved = torch.load(pt, weights_only=True)
    assert saved.dtype == torch_dtype and tuple(saved.shape) == (2, 1, 4, 4)
    assert saved[:, 0].tolist() == want
    if numpy_dtype is None:
        return
    npy = tmp_path / "mask.npy"
    ok([*base, "--save", npy])
    loaded = np.load(npy, allow_pickle=False)
    assert loaded.dtype == numpy_dtype and loaded.shape == (2, 1, 4, 4)
    assert loaded[:, 0].tolist() == want


def test_save_pth_is_torch_saves_file_as_pt_is(tmp_path):
    """hunt 10: `--save m.pth` was refused ("unknown extension '.pth'") though .pth is read as torch.save's file."""
    result = ok(["show", "causal", "--len", "4", "--save", tmp_path / "m.pth"])
    assert f"wrote {tmp_path / 'm.pth'} (keep convention)" in result.stderr
    assert torch.equal(torch.load(tmp_path / "m.pth", weights_only=True)[0, 0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_additive_save_is_what_nn_transformer_builds(tmp_path):
    ok(["show", "causal", "--len", "4", "--as", "additive", "--save", tmp_path / "m.pt"])
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)[0, 0], torch.nn.Transformer.generate_square_subsequent_mask(4))


def test_save_with_json_writes_the_file_and_prints_the_same_convention(tmp_path):
    path = tmp_path / "m.npy"
    got = json.loads(ok(["show", "window", "--len", "3", "--window", "2", "--as", "block", "--save", path, "--json"]).stdout)
    assert got["convention"] == "block" and got["mask"] == [[[[0, 1, 1], [0, 0, 1], [1, 0, 0]]]]
    additive = json.loads(ok(["show", "causal", "--len", "2", "--as", "additive", "--json"]).stdout)
    assert additive["mask"] == [[[[0.0, "-inf"], [0.0, 0.0]]]] and additive["dtype"] == "float32"
    assert np.load(path).tolist() == [[[[False, True, True], [False, False, True], [True, False, False]]]]


def test_a_directory_gets_a_file_named_after_the_mask(tmp_path):
    result = ok(["show", "causal & window(3)", "--len", "4", "--save", tmp_path, "--png", tmp_path])
    assert (tmp_path / "causal_and_window_3.npy").exists() is False
    assert (tmp_path / "causal_and_window_3.pt").exists() and (tmp_path / "causal_and_window_3.png").exists()
    assert f"wrote {tmp_path / 'causal_and_window_3.png'}" in result.stderr


def test_save_refuses_a_tensor_bigger_than_the_free_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))  # 100 bytes free
    path = tmp_path / "big.pt"
    result = invoke(["show", "causal", "--len", "16", "--save", path])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"maskcli: error: --save {str(path)!r} would write 256 bytes but the disk there has 100 bytes free: use a smaller --len, or --png for a picture of it\n"
    assert not path.exists()


def test_dtype_with_a_bool_or_int_convention_is_said_to_be_ignored():
    result = invoke(["show", "causal", "--len", "2", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "maskcli: warning: --dtype float16 is ignored: it is for --as additive and --as min, and --as keep has a dtype of its own\n"
    quiet = invoke(["show", "causal", "--len", "2", "--as", "min", "--dtype", "float16"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
    assert "convention: min float16" in quiet.stdout


# --- bad input ----------------------------------------------------------------------


BAD = [
    (["chunk", "0,a,1", "--save", "m.pt"], ["'a'", "position 1"]),
    (["chunk", "0,1,2.5", "--png", "m.png"], ["'2.5'", "position 2"]),
    (["show", "document", "--chunks", "0,x", "--json"], ["'x'"]),
    (["chunk", "", "--save", "m.pt"], ["no values"]),
    (["chunk", " , ", "--png", "m.png"], ["no values"]),
    (["show", "causal", "--len", "0", "--save", "m.pt"], ["--len", "got 0"]),
    (["show", "causal", "--len", "-2", "--png", "m.png"], ["--len", "got -2"]),
    (["show", "causal", "--len", "six"], ["'six'"]),
    (["show", "padding", "--lengths", "3,7", "--len", "5", "--save", "m.pt"], ["length 7", "5 positions"]),
    (["show", "causal", "--lengths", "9", "--len", "4", "--png", "m.png"], ["length 9", "4 positions"]),
    (["show", "padding", "--ids", "1,2,0", "--len", "4"], ["3 tokens", "4 positions"]),
    (["show", "causal", "--len", "3", "--tokens", "a b", "--save", "m.npy"], ["--tokens 'a b' have 2 entries", "positions 0-2"]),
    (["chunk", "0,0,1", "--tokens", "one two three four"], ["4 entries", "positions 0-2"]),
    (["show", "window", "--len", "4", "--window", "0", "--png", "m.png"], ["--window 0", "at least 1"]),
    (["show", "window", "--len", "4", "--window", "-3"], ["--window -3"]),
    (["show", "prefix", "--len", "4", "--prefix", "0", "--save", "m.pt"], ["--prefix 0"]),
    (["show", "prefix", "--len", "4", "--prefix", "5"], ["prefix of 5", "4 tokens"]),
    (["show", "banana", "--save", "m.pt"], ["'banana'", "the kinds are full, causal"]),
    (["show", "windw(3)"], ["'windw'", "did you mean window?"]),
    (["show", "causal & & window(3)", "--png", "m.png"], ["at character 10; "]),
    (["show", "causal & (window(3)"], ["expected ')'"]),
    (["show", "causal", "--png", "missing/m.png"], ["'missing'"]),
    (["show", "causal", "--save", "missing/deeper/m.pt"], ["'missing/deeper'"]),
    (["show", "causal", "--png", "m.gif"], ["'.gif'", ".png, .svg, .pdf"]),
    (["show", "causal", "--html", "m.png"], ["--html 'm.png'", "'.png'", "use one of .html"]),
    (["show", "causal", "--html", "missing/m.html"], ["--html 'missing/m.html'", "directory 'missing' does not exist"]),
    (["show", "causal", "--html", ""], ["--html is empty: give a file name"]),
    (["show", "causal", "--html", "m.html", "--why", "9,0"], ["--why 9,0", "outside the queries 0-7"]),
    (["show", "causal", "--save", "m.txt"], ["'.txt'", ".pt, .npy"]),
    (["chunk", "0,1", "--save", "m"], ["'m'", ".pt, .npy"]),
    (["show", "causal", "--len", "3000000", "--json"], [f"--json would list {3_000_000**2:,} mask cells, past the 4,194,304 it prints"]),
    (["show", "causal", "--len", "3000000", "--save", "m.pt"], [f"({3_000_000**2 * 2:,} bytes)"]),
    (["show", "causal", "--as", "sideways"], ["'sideways'", "keep, block, additive, min, int"]),
    (["show", "causal", "--as", "min", "--dtype", "float8"], ["'float8'"]),
    (["show", "causal", "--as", "min", "--dtype", "bfloat16", "--save", "m.npy"], ["bfloat16", ".npy"]),
    (["show", "tril", "--means", "both"], ["'both'"]),
    (["show", "causal", "--window", "3"], ["--window 3", "'causal'"]),
    (["show", "window(4)", "--window", "3"], ["window(4) in the expression gives its own"]),
    (["show", "padding"], ["--lengths"]),
    (["show", "padding", "--ids", "1,2;3"], ["'1,2;3'"]),
    (["chunk", "0,1", "--len", "3"], ["2 entries", "positions 0-2"]),
    (["show", "causal", "--align", "bottom-right"], ["without --kv-len"]),
    (["show", "causal", "--kv-start", "9", "--len", "4"], ["--kv-start 9 leaves no key"]),
    (["show"], ["give a mask: an expression like", "--mask FILE, or --mask-mod FILE.py:NAME"]),
]


@pytest.mark.parametrize("args, quoted", BAD, ids=[" ".join(args) for args, _ in BAD])
def test_bad_input_is_one_line_exit_2_no_traceback_no_file(args, quoted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 16 << 30)  # the same answer on every machine
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an escaped exception
    assert result.stderr.endswith("\n")
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ")
    for text in quoted:
        assert text in line
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_png_onto_a_directory_named_like_a_file_writes_into_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.png").mkdir()
    ok(["show", "causal", "--png", "out.png"])
    assert [p.name for p in (tmp_path / "out.png").iterdir()] == ["causal.png"]


# --- help and imports ----------------------------------------------------------------


def test_help_lists_every_kind_ends_with_examples_and_says_how_window_counts():
    from maskcli.kinds import all_kinds

    text = " ".join(ok(["show", "--help"], env={"COLUMNS": "200"}).stdout.replace("│", " ").split())
    assert "maskcli show causal --len 6" in text and 'maskcli show "document(0,0,0,1,1,1) & window(2)"' in text
    for kind in all_kinds():
        assert kind.signature in text
    assert "maskcli kinds explains each" in text and "a bare kind takes flags (--window 3; maskcli kinds lists them)" in text
    for flag in ("--offset", "--kv-start", "--kv-len", "--align", "--rows", "--keys"):
        assert flag in text
    # the kind-parameter flags are folded out of help (an expression carries its parameters): kinds lists them
    kinds = " ".join(ok(["kinds"], env={"COLUMNS": "200"}).stdout.split())
    assert "itself and the W-1 before it (Hugging Face's count; FlashAttention window_size=(W-1, 0))" in kinds
    for flag in ("--window", "--prefix", "--sink", "--chunk-size", "--chunks", "--sizes", "--block-ids", "--parents", "--diagonal", "--means"):
        assert flag in kinds and f"{flag} " not in text.split("Examples:")[0].replace("(--window 3;", "")
    assert ok(["show", "window", "--window", "2", "--len", "3", "--json"]).stdout.count("1") >= 5  # still taken
    assert "maskcli chunk 0,0,1,1,1,1,2,2,2,3,4,4" in " ".join(ok(["chunk", "--help"]).stdout.split())


def test_version():
    import maskcli

    assert ok(["--version"]).stdout.strip() == f"maskcli {maskcli.__version__}"


def imported_modules(*args):
    """Top-level modules `python -X importtime -m maskcli ARGS` imported, and its stdout."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "maskcli", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "100"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    assert "maskcli" in names  # the parse worked
    return names, result.stdout


def test_help_imports_neither_torch_nor_matplotlib():
    for args in (["--help"], ["show", "--help"], ["kinds"]):
        names, stdout = imported_modules(*args)
        assert "torch" not in names and "matplotlib" not in names, args


def test_a_table_a_map_and_json_import_neither_torch_nor_matplotlib():
    names, stdout = imported_modules("show", "document(0,0,1,1) & window(2)")
    assert "numpy" in names  # the check can see what it looks for
    assert "torch" not in names and "matplotlib" not in names
    assert table_rows(stdout)[-1] == "3 0 0 1 1"
    for args in (["show", "window(128)", "--len", "100000"], ["show", "causal", "--len", "4", "--json"],
                 ["show", "window(8)", "--len", "100000", "--summary", "--json"], ["chunk", "0,0,1"], ["kinds", "--json"]):
        names, _ = imported_modules(*args)
        assert "torch" not in names and "matplotlib" not in names, args


def test_figures_and_npy_need_no_torch(tmp_path):
    for args in (["show", "causal", "--len", "4", "--png", str(tmp_path / "m.png")],
                 ["show", "causal", "--len", "4", "--as", "min", "--save", str(tmp_path / "m.npy")],
                 ["blocks", "window(64)", "--len", "4096", "--png", str(tmp_path / "b.png")]):
        names, _ = imported_modules(*args)
        assert "torch" not in names, args


def test_mask_files_are_shown_without_importing_torch(tmp_path):
    import maskfiles

    names = list(maskfiles.write(tmp_path).values())
    commands = [["show", "--mask", name, *extra] for name in names for extra in ([], ["--json"], ["--summary"])]
    ran = maskfiles.torch_after_each(commands, tmp_path)
    assert [code for _, code, _ in ran] == [0] * len(commands)
    assert not any(loaded for *_, loaded in ran), [args for args, _, loaded in ran if loaded][:1]


def test_mask_files_show_the_cells_they_hold(tmp_path):
    import maskfiles

    for label, name in maskfiles.write(tmp_path).items():
        data = json.loads(ok(["show", "--mask", str(tmp_path / name), "--json"]).stdout)
        assert np.array_equal(np.array(data["mask"], dtype=bool)[0, 0], maskfiles.reference()), label


@pytest.mark.parametrize("command", ["show", "chunk", "attend", "verify", "inspect", "convert", "kinds"])
def test_every_option_has_its_own_name(command):
    """Shared options reach each command under the names the user types, never the Python ones."""
    text = ok([command, "--help"], env={"COLUMNS": "200"}).stdout
    assert not re.search(r"--[moi]-[a-z]", text), text


# --- statistics ----------------------------------------------------------------------------


def test_summary_in_words():
    out = ok(["show", "document(0,0,1,1,1)", "--lengths", "5,2", "--summary"]).stdout
    assert lines(out) == [
        "document(0,0,1,1,1) · lengths 5,2 · shape (B=2, H=1, Lq=5, Lk=5)",
        "visible cells: 12 of 50 (24.00%) · exact, from key intervals",
        "batch 0 (length 5): visible 9 of 25 (36.00%)",
        "keys per query row: min 1 · median 2 · max 3",
        "rows that see no key: none",
        "documents: 2, starting at 0, 2",
        "batch 1 (length 2): visible 3 of 25 (12.00%)",
        "keys per query row: min 0 · median 0 · max 2",
        "rows that see no key: 3 (2-4)",
        "documents: 2, starting at 0, 2",
        "attention FLOPs: 4·D per visible cell = 48·D, 24.00% of dense (200·D) for head size D",
    ]


def test_summary_json_counts_a_million_token_mask_exactly():
    got = json.loads(ok(["show", "window(4096)", "--len", 1 << 20, "--heads", 2, "--summary", "--json", "--grid", "4,8"]).stdout)
    n, w = 1 << 20, 4096
    per_head = w * (w + 1) // 2 + (n - w) * w
    assert got["visible_cells"] == 2 * per_head and got["total_cells"] == 2 * n * n
    assert got["batch_rows"][0]["row_keys"] == {"min": 1, "median": 4096.0, "max": 4096}
    assert got["flops"]["per_head_dim"] == 4 * got["visible_cells"]
    assert got["batch_rows"][0]["visible_cells"] == 2 * per_head  # every head, as the top level counts
    grid = np.array(got["grid"]["visible"][0])
    assert grid.shape == (4, 8) and grid.sum() == 2 * per_head
    assert (got["grid"]["queries_per_block"], got["grid"]["keys_per_block"]) == (n // 4, n // 8)


def test_grid_needs_summary_json_and_json_of_a_huge_mask_points_to_summary():
    result = invoke(["show", "causal", "--grid", "2,2"])
    assert result.exit_code == 2 and "add --summary --json" in result.stderr
    bad = invoke(["show", "causal", "--summary", "--json", "--grid", "2"])
    assert bad.exit_code == 2 and "--grid '2' is not R,C" in bad.stderr
    huge = invoke(["show", "causal", "--len", 1 << 20, "--json"])
    assert huge.exit_code == 2 and "--summary --json for exact counts at any length" in huge.stderr


def test_json_cells_past_what_json_prints_are_refused_before_any_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    most = 1 << 22  # 2,048 x 2,048 cells: printed whole (about 12 MB)
    whole = ok(["show", "causal", "--len", 2048, "--json"])
    cells = np.array(json.loads(whole.stdout)["mask"], dtype=bool)
    assert cells.size == most and np.array_equal(cells[0, 0], np.tril(np.ones((2048, 2048), dtype=bool)))
    for args, count in ((["--len", 2049], 2049**2), (["--len", 1024, "--heads", 5], 5 * 1024**2), (["--len", 20000], 20000**2)):
        result = invoke(["show", "causal", *args, "--json", "--save", "m.npy", "--png", "m.png"])
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert result.stderr == (
            f"maskcli: error: --json would list {count:,} mask cells, past the {most:,} it prints: use a smaller --len, "
            "or --summary --json for exact counts at any length (--save writes the cells to a .npy or .pt file)\n"
        )
    assert list(tmp_path.iterdir()) == []
    summary = ok(["show", "causal", "--len", 20000, "--summary", "--json"])  # counts have no such limit
    assert json.loads(summary.stdout)["visible_cells"] == 20000 * 20001 // 2


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_appears_only_after_a_second_and_only_on_a_terminal(monkeypatch, capsys, terminal):
    from maskcli.commands import progress as module

    monkeypatch.setenv("TTY_COMPATIBLE", "1" if terminal else "0")  # rich's own switch: is stderr a terminal
    clock = iter([0.0, 0.5, 2.0])
    monkeypatch.setattr(module, "now", lambda: next(clock))
    started = []
    import rich.progress

    real_start = rich.progress.Progress.start
    monkeypatch.setattr(rich.progress.Progress, "start", lambda self: (started.append(True), real_start(self)))
    with module.progress("counting") as update:
        update(1, 10)  # half a second in: nothing drawn
        assert started == []
        update(5, 10)  # two seconds in: the bar starts
        update(10, 10)
    assert started == ([True] if terminal else [])
    if not terminal:  # a log or a pipe gets no bar, not even the empty line rich leaves behind
        assert capsys.readouterr().err == ""


# --- tables never lose a cell ----------------------------------------------------------------


@pytest.mark.parametrize("length, columns", [(l, 120) for l in range(30, 42)] + [(l, 60) for l in range(14, 22)])
def test_a_table_shows_every_column_or_the_mask_becomes_a_map(length, columns):
    out = ok(["show", "causal", "--len", length], env={"COLUMNS": str(columns)}).stdout
    assert "…" not in out
    if "one character" in out:
        rows, cols, body = map_of(out)
        assert (rows, cols) == (1, 1)  # one cell a character while the width and height allow: still exact
        assert [chars for _, chars in body] == ["█" * (i + 1) + "·" * (length - i - 1) for i in range(length)]
    else:
        assert table_rows(out)[-1] == f"{length - 1} " + " ".join(["1"] * length)
    assert all(len(line) <= columns for line in out.splitlines())


def test_piped_output_keeps_a_table_whole_at_its_own_width():
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    result = subprocess.run([sys.executable, "-m", "maskcli", "show", "causal", "--len", "30"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and table_rows(result.stdout)[-1] == "29 " + " ".join(["1"] * 30)


def test_piped_output_draws_a_mask_of_1000_keys_as_an_80_column_map_and_says_how_to_get_the_cells():
    out = ok(["show", "causal", "--offset", 996, "--len", 4], env={"COLUMNS": None}).stdout  # piped, no COLUMNS
    assert max(map(len, out.splitlines())) <= 80  # was one 4,000-character line per query
    rows, cols, body = map_of(out)
    assert (rows, cols) == (1, 14)
    for q, (label, chars) in zip(range(996, 1000), body, strict=True):
        shares = [sum(kv <= q for kv in range(k, min(k + cols, 1000))) / len(range(k, min(k + cols, 1000))) for k in range(0, 1000, cols)]
        assert (label, chars) == (str(q), "".join("█" if s == 1 else "▓" if s > 0.5 else "░" if s > 0 else "·" for s in shares))
    assert " ".join(out.split()).endswith(
        "a density map, not the cells: 1,000 keys do not fit a table 512 columns wide: --keys A:B shows some of them "
        "as one, --json or --save has every cell")
    part = ok(["show", "causal", "--offset", 996, "--len", 4, "--keys", "990:"], env={"COLUMNS": None}).stdout
    assert table_rows(part) == [f"{q} " + " ".join("1" if kv <= q else "0" for kv in range(990, 1000)) for q in range(996, 1000)]
    tall = ok(["show", "causal", "--len", 2000], env={"COLUMNS": None}).stdout
    assert " ".join(tall.split()).endswith(
        "a density map, not the cells: 2,000 queries are more than a table shows: --rows A:B with --keys C:D shows some "
        "of them as one, --json or --save has every cell")
    assert "not the cells" not in ok(["show", "causal", "--len", 2000], env={"COLUMNS": "100"}).stdout  # a terminal's map


def test_words_too_wide_for_the_columns_label_the_rows():
    words = "internationalization is extraordinarily uncharacteristically incomprehensible"
    out = ok(["show", "causal", "--tokens", words], env={"COLUMNS": "60"}).stdout
    assert "--tokens label the rows: the columns, too narrow for the words, are key positions" in " ".join(out.split())
    assert table_rows(out)[0] == "0 internationalization 1 0 0 0 0"


def test_rows_that_see_no_key_are_said_on_stderr():
    assert invoke(["show", "tril(-1)"]).stderr == (
        "maskcli: warning: 1 query row sees no key (0): softmax over nothing is NaN with an -inf fill "
        "(maskcli attend shows what each fill makes of it)\n"
    )
    both = invoke(["show", "causal", "--lengths", "0,2", "--len", "3"]).stderr
    assert "3 query rows see no key (0-2 of batch row 0)" in both
    assert invoke(["show", "causal", "--len", "3"]).stderr == ""


@pytest.mark.parametrize("args, says", [
    (["show", "tree(0,0)"], "parents[0] is 0; the first draft token has no earlier one, so its parent is -1 (a root)"),
    (["show", "document(sizes=3,5)"], "a list goes in brackets: sizes=[3,5,...]"),
    (["show", "window(2.5)"], "2.5 is not a whole number"),
    (["convert", "m.pt", "--to", "keep"], "Missing option '--out' (see 'maskcli convert --help')"),
])
def test_messages_say_what_was_meant(args, says):
    result = invoke(args)
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("\n") == 1


# --- the user's own masks ----------------------------------------------------------------------

GYM = os.path.join(os.path.dirname(__file__), "data", "gym_masks.py")


def test_show_a_pytorch_mask_file_names_the_file_and_its_convention(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short name: a long path is shortened in the title (pytest-xdist's are long)
    torch.save(torch.nn.Transformer.generate_square_subsequent_mask(4), "square.pt")
    out = ok(["show", "--mask", "square.pt"]).stdout
    assert lines(out)[0] == "'square.pt' (read as additive) · shape (B=1, H=1, Lq=4, Lk=4)"
    assert table_rows(out) == ["0 1 0 0 0", "1 1 1 0 0", "2 1 1 1 0", "3 1 1 1 1"]


def test_show_a_hugging_face_style_mask_puts_its_queries_at_the_end(tmp_path):
    keep = torch.ones(2, 5, dtype=torch.bool).tril(3)
    np.savez(tmp_path / "m.npz", input_ids=np.arange(5), mask=torch.zeros(1, 1, 2, 5).masked_fill(~keep, torch.finfo(torch.float32).min).numpy())
    out = ok(["show", "--mask", tmp_path / "m.npz", "--key", "mask"]).stdout
    assert "(read as min) · shape (B=1, H=1, Lq=2, Lk=5) · queries 3-4 · keys 0-4" in lines(out)[0]
    assert table_rows(out) == ["3 1 1 1 1 0", "4 1 1 1 1 1"]


def test_show_a_mask_mod_and_an_expression_that_uses_it():
    out = ok(["show", "--mask-mod", f"{GYM}:generate_sliding_window", "--mask-mod-args", "1", "--len", "4"]).stdout
    assert lines(out)[0] == "generate_sliding_window · shape (B=1, H=1, Lq=4, Lk=4)"
    assert table_rows(out) == ["0 1 0 0 0", "1 1 1 0 0", "2 0 1 1 0", "3 0 0 1 1"]
    mixed = ok(["show", "causal_mask & ~window(2)", "--mask-mod", f"{GYM}:causal_mask", "--len", "4"]).stdout
    assert table_rows(mixed) == ["0 0 0 0 0", "1 0 0 0 0", "2 1 0 0 0", "3 1 1 0 0"]


@pytest.mark.parametrize("args, says", [
    (["causal", "--mask", "m.pt"], "give an expression or --mask"),
    (["--mask", "m.pt", "--len", "3"], "--len does not apply to --mask"),
    (["--mask", "all.pt"], "cannot tell whether"),
    (["--mask-mod", f"{GYM}:returns_floats", "--len", "3"], "returned float32 values"),
    (["--key", "x"], "--key x is for --mask FILE"),
])
def test_bad_own_masks_are_one_line(args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(torch.tril(torch.ones(3, 3)).bool(), tmp_path / "m.pt")
    torch.save(torch.ones(3, 3, dtype=torch.bool), tmp_path / "all.pt")
    result = invoke(["show", *args])
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("\n") == 1
    assert table_rows(ok(["show", "--mask", "all.pt", "--from", "keep"]).stdout) == ["0 1 1 1", "1 1 1 1", "2 1 1 1"]


def test_triu_shown_as_keep_says_where_the_raw_matrix_is():
    shown = ok(["show", "triu", "--len", "3"]).stdout.splitlines()
    assert shown[2] == "the raw torch.triu matrix (1 = masked) is what --as block shows"
    assert [line.split() for line in shown[-3:]] == [["0", "1", "0", "0"], ["1", "1", "1", "0"], ["2", "1", "1", "1"]]
    raw = ok(["show", "triu", "--len", "3", "--as", "block"]).stdout.splitlines()
    assert "raw torch.triu" not in "\n".join(raw)
    assert [line.split() for line in raw[-3:]] == [["0", "0", "1", "1"], ["1", "0", "0", "1"], ["2", "0", "0", "0"]]
    assert "raw torch.triu" not in ok(["show", "tril", "--len", "3"]).stdout


def test_ids_rows_of_different_lengths_are_named_in_the_order_typed():
    result = invoke(["show", "causal", "--ids", "1,2;3"])
    assert result.exit_code == 2
    assert "--ids '1,2;3': the batch rows have 2, 1 tokens, in that order" in result.stderr


def test_structure_marks_in_tables():
    docs = lines(ok(["show", "document(0,0,0,1,1,2,2,2) & window(3)", "--offset", "2", "--len", "6"]).stdout)
    assert docs[2].startswith("│ ─ doc boundaries (labels above the keys, beside the queries) · ║ cached keys | new keys")
    assert docs[3:] == [
        "0 0 ║ 0 │ 1 1 │ 2 2 2",  # each key's document
        "q \\ kv doc 0 1 ║ 2 │ 3 4 │ 5 6 7",  # the cache ends before query 2: ║; documents change at 3 and 5: │
        "2 0 1 1 ║ 1 │ 0 0 │ 0 0 0",
        "─ ─ ┼ ─ ┼ ─ ─ ┼ ─ ─ ─",
        "3 1 0 0 ║ 0 │ 1 0 │ 0 0 0",
        "4 1 0 0 ║ 0 │ 1 1 │ 0 0 0",
        "─ ─ ┼ ─ ┼ ─ ─ ┼ ─ ─ ─",
        "5 2 0 0 ║ 0 │ 0 0 │ 1 0 0",
        "6 2 0 0 ║ 0 │ 0 0 │ 1 1 0",
        "7 2 0 0 ║ 0 │ 0 0 │ 1 1 1",
    ]
    padded = lines(ok(["show", "causal", "--ids", "0,0,5,6;7,8,9,0"]).stdout)
    assert padded[2] == "p / pad: padding · underlined: the diagonal"
    assert padded[3:10] == ["batch 0 (ids 0,0,5,6)", "p p", "q \\ kv 0 1 2 3", "0 pad 0 0 0 0", "1 pad 0 0 0 0", "2 0 0 1 0", "3 0 0 1 1"]
    assert padded[10:] == ["batch 1 (ids 7,8,9,0)", "p", "q \\ kv 0 1 2 3", "0 1 0 0 0", "1 1 1 0 0", "2 1 1 1 0", "3 pad 1 1 1 0"]
    plain = lines(ok(["show", "causal", "--len", "3"]).stdout)
    assert plain[2:] == ["q \\ kv 0 1 2", "0 1 0 0", "1 1 1 0", "2 1 1 1"]  # nothing to mark: the table as it was


# --- padding side, and files for --lengths, --ids and --tokens -----------------------------------------------


def _cells(args):
    return np.array(json.loads(ok(["show", *args, "--json"]).stdout)["mask"], dtype=bool)


@pytest.mark.parametrize("expression, keep", [
    ("causal", lambda q, kv, first: kv <= q),
    ("window(3)", lambda q, kv, first: q - 3 < kv <= q),
    ("local(2)", lambda q, kv, first: kv <= q and (q - first) // 2 == (kv - first) // 2),  # chunks from the first real token
])
def test_pad_left_puts_the_padding_before_the_last_length_keys(expression, keep):
    n, lengths = 7, [3, 7, 0]
    got = _cells([expression, "--lengths", ",".join(map(str, lengths)), "--pad", "left"])
    for b, length in enumerate(lengths):
        first = n - length  # Hugging Face's padding_side="left": the real tokens are the last `length`
        expected = [[kv >= first and keep(q, kv, first) for kv in range(n)] for q in range(n)]
        assert got[b, 0].tolist() == expected, b
    ids = ";".join(",".join("0" if i < n - length else "1" for i in range(n)) for length in lengths)
    assert np.array_equal(got, _cells([expression, "--ids", ids]))  # the same as the left padding --ids shows
    right = _cells([expression, "--lengths", ",".join(map(str, lengths)), "--pad", "right"])
    assert np.array_equal(right, _cells([expression, "--lengths", ",".join(map(str, lengths))]))
    out = ok(["show", expression, "--lengths", "3,7,0", "--pad", "left", "--summary", "--json"]).stdout
    assert json.loads(out)["padding_side"] == "left" and json.loads(out)["visible_cells"] == int(got.sum())


def test_lengths_ids_and_tokens_come_from_files_as_labels_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("lengths.npy", np.array([3, 5]))
    (tmp_path / "lengths.json").write_text("[3, 5]")
    (tmp_path / "lengths.txt").write_text("3 5\n")
    torch.save(torch.tensor([3, 5]), tmp_path / "lengths.pt")
    inline = _cells(["causal", "--lengths", "3,5"])
    for name in ("lengths.npy", "lengths.json", "lengths.txt", "lengths.pt"):
        assert np.array_equal(_cells(["causal", "--lengths", name]), inline), name
    ids = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    np.save("ids.npy", ids)
    (tmp_path / "ids.txt").write_text("0 0 5 6 7\n1 2 3 4 5\n")
    inline = _cells(["causal", "--ids", "0,0,5,6,7;1,2,3,4,5"])
    assert np.array_equal(_cells(["causal", "--ids", "ids.npy"]), inline) and np.array_equal(_cells(["causal", "--ids", "ids.txt"]), inline)
    (tmp_path / "words.txt").write_text("Your journey\nstarts with one step\n")
    (tmp_path / "words.json").write_text('["Your", "journey", "starts", "with", "one", "step"]')
    for name in ("words.txt", "words.json"):
        data = json.loads(ok(["show", "causal", "--tokens", name, "--json"]).stdout)
        assert data["tokens"] == ["Your", "journey", "starts", "with", "one", "step"] and data["shape"] == [1, 1, 6, 6]
    assert " 1 journey   1" in ok(["show", "causal", "--tokens", "words.txt"]).stdout


@pytest.mark.parametrize("args, says", [
    (["causal", "--pad", "left"], "--pad left says where --lengths puts the padding: give --lengths too"),
    (["causal", "--pad", "up", "--lengths", "2"], "unknown --pad 'up': choose left or right"),
    (["causal", "--pad", "left", "--ids", "0,1"], "(--ids shows the padding where it is)"),
    (["causal", "--tokens", "missing.txt"], "--tokens 'missing.txt': no such file"),
    (["causal", "--lengths", "missing.npy"], "--lengths 'missing.npy': no such file"),
    (["causal", "--ids", "ids2.txt", "--len", "2"], "--ids 'ids2.txt': 'x' is not an integer"),
    (["causal", "--save", "nodir/"], "--save 'nodir/': folder 'nodir' does not exist; create it first, or give a file name"),
    (["causal", "--png", "nodir/"], "--png 'nodir/': folder 'nodir' does not exist"),
    (["causal", "--html", "nodir/"], "--html 'nodir/': folder 'nodir' does not exist; create it first, or give a file name"),
    (["causal", "--save", "nodir/m.npy"], "directory 'nodir' does not exist; create it first"),
])
def test_bad_padding_and_files_are_one_line(args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ids2.txt").write_text("0 x\n")
    result = invoke(["show", *args])
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids2.txt"]


# --- regions ---------------------------------------------------------------------------------------------


def test_a_region_shows_its_part_with_the_whole_masks_labels_and_cache_edge():
    out = ok(["show", "document(sizes=[300,212]) & window(128)", "--rows", "298:302", "--keys", "295:303"]).stdout
    assert lines(out)[:2] == [
        "document(sizes=[300,212]) & window(128) · a region of queries 0-511 · keys 0-511 · shape (B=1, H=1, Lq=4, Lk=8) · queries 298-301 · keys 295-302",
        "convention: keep (bool, 1 = True = may attend, 0 = masked)",
    ]
    assert " 299     0     1    1    1    1    1   │   0    0    0" in out  # the doc boundary at 300, from the whole mask
    assert "║" not in out  # no cache: the whole mask's queries start at key 0
    cached = ok(["show", "window(4)", "--offset", "10", "--len", "3", "--keys", "8:"]).stdout
    assert " 10      1  1  ║  1   0   0" in cached  # the cache edge is where the whole mask's queries start


def test_a_regions_json_and_summary_are_the_slice_of_the_whole(tmp_path):
    args = ["document(0,0,0,1,1,1,1,2,2)", "--lengths", "9,6"]
    whole = np.array(json.loads(ok(["show", *args, "--json"]).stdout)["mask"], dtype=bool)
    data = json.loads(ok(["show", *args, "--rows", "2:7", "--keys", ":5", "--json"]).stdout)
    assert np.array_equal(np.array(data["mask"], dtype=bool), whole[:, :, 2:7, :5])
    assert data["region"] == {"rows": [2, 7], "keys": [0, 5], "of": {"rows": [0, 9], "keys": [0, 9]}}
    summary = json.loads(ok(["show", *args, "--rows", "2:7", "--keys", ":5", "--summary", "--json"]).stdout)
    assert summary["visible_cells"] == int(whole[:, :, 2:7, :5].sum())
    chunk = json.loads(ok(["chunk", "0,0,1,1,2,2", "--rows", "4:", "--json"]).stdout)
    assert chunk["mask"] == [[[[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]]]  # label 2 sees every label up to 2
    png = tmp_path / "region.png"
    ok(["show", "window(4096)", "--len", "1048576", "--rows", "500000:500016", "--keys", "495000:500016", "--png", png])
    assert png.stat().st_size > 0


def test_a_region_of_a_million_tokens_costs_its_own_cells():
    from bounded import MIB, builds_under

    with builds_under(512 * MIB):  # the region's 24 cells, and a few arrays of a million positions, not 10^12 cells
        out = ok(["show", "document(sizes=[300000,748576]) & window(4096)", "--rows", "299998:300002", "--keys",
                  "299996:300002"]).stdout
    assert " 299999  0      1       1       1       1     │    0       0" in out
    assert " 300000  1      0       0       0       0     │    1       0" in out


@pytest.mark.parametrize("args, says", [
    (["causal", "--rows", "5:3"], "--rows 5:3 is outside the queries 0-7 of this mask (or empty): give A:B with 0 <= A < B <= 8"),
    (["causal", "--keys", "x"], "--keys 'x' is not a range: give A:B"),
    (["causal", "--offset", "4", "--len", "2", "--rows", ":4"], "--rows :4 is outside the queries 4-5"),
])
def test_a_bad_region_is_one_line(args, says):
    result = invoke(["show", *args])
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_summary_counts_documents_and_blocks_and_says_where_they_start():
    sizes = [3000] * 11 + [1000]
    out = ok(["show", f"document(sizes=[{','.join(map(str, sizes))}]) & window(64)", "--summary"]).stdout
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert f"documents: 12, starting at {', '.join(f'{s:,}' for s in starts[:8])} and 4 more" in lines(out)
    data = json.loads(ok(["show", "causal | blocks(-1,0,0,-1,1,1,-1)", "--summary", "--json"]).stdout)
    assert data["batch_rows"][0]["blocks"] == {"count": 2, "starts": [1, 4]}  # runs of ids >= 0
    many = ",".join(str(i % 7) for i in range(5000))  # 5,000 one-token documents: every start listed up to 1,024
    data = json.loads(ok(["show", f"document({many})", "--summary", "--json"]).stdout)["batch_rows"][0]["documents"]
    assert data["count"] == 5000 and data["starts"] == list(range(1024)) and data["starts_listed"] == 1024


# --- --html (the page itself is checked in a browser: tests/test_render_html.py) --------------------------


def test_html_writes_one_self_contained_page_and_still_prints_the_table(tmp_path):
    path = tmp_path / "m.html"
    result = ok(["show", "document(0,0,1,1) & window(2)", "--html", path])
    assert result.stderr == f"wrote {path}\n"
    assert lines(result.stdout)[-1] == "3 1 0 0 │ 1 1"
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and '"page":"show"' in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
    data = json.loads(re.search(r'<script type="application/json" id="mask-data">(.*?)</script>', page, re.S).group(1))
    assert data["masks"][0]["text"] == "document(0,0,1,1) & window(2)" and data["masks"][0]["frame"]["lq"] == 4


def test_html_onto_a_folder_is_named_after_the_mask_and_a_million_tokens_stay_small(tmp_path):
    result = ok(["show", "document(sizes=[300000,400000,348576]) & window(4096)", "--html", tmp_path])
    path = tmp_path / "document_sizes_300000_400000_348576_and_window_4096.html"
    assert f"wrote {path}" in result.stderr
    assert "the terminal map is left out beside --html for a mask of 1,048,576 x 1,048,576" in result.stderr
    assert path.stat().st_size < 1 << 20  # a few runs of affine rows, not a million rows


def test_html_of_a_tensor_too_scattered_for_a_page_is_refused_whole(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("scattered.npy", np.random.default_rng(0).random((3000, 3000)) < 0.5)  # about 750 runs in every row
    result = invoke(["show", "--mask", "scattered.npy", "--from", "keep", "--html", "m.html", "--png", "m.png", "--save", "m.pt"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("maskcli: error: --html: the cells of \"'scattered.npy' (read as keep)\" take ")
    assert "past the 3,000,000 a page holds: view a region with --rows/--keys" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scattered.npy"]


def test_chunk_names_its_labels_argument_in_errors_not_chunks_flag():
    result = runner.invoke(app, ["chunk", "0,1,a"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == "maskcli: error: chunk labels '0,1,a': 'a' at position 2 of '0,1,a' is not an integer (write them like 0,0,1,1)\n"
    flag = runner.invoke(app, ["show", "chunk", "--chunks", "0,1,a"])  # given as the flag, the flag is named
    assert flag.stderr.startswith("maskcli: error: --chunks '0,1,a': 'a' at position 2")


def test_a_parameter_below_its_minimum_reads_without_nested_parentheses():
    result = runner.invoke(app, ["show", "window(-2)"])
    assert result.exit_code == 2 and result.stderr == (
        "maskcli: error: window(-2): window must be at least 1, got -2; window = keys each query sees: itself and the "
        "W-1 before it (Hugging Face's count; FlashAttention window_size=(W-1, 0))\n"
    )


def test_what_was_written_wraps_between_words_on_a_narrow_terminal(tmp_path, monkeypatch):
    """The note beside --png of a long mask was echoed as one line, so a 60-column terminal cut it mid-number
    ('4,09' / '6 x 4,096'): it wraps at spaces now, as warnings do."""
    monkeypatch.chdir(tmp_path)
    path = "c.png"
    result = ok(["show", "causal", "--len", "4096", "--png", path], env={"COLUMNS": "60"})
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"wrote {path}",
        "the terminal map is left out beside --png for a mask of",
        "  4,096 x 4,096: the figure has it; run without --png to",  # two cells in, never at column 0
        "  print the map too",
    ]
    piped = ok(["show", "causal", "--len", "4096", "--png", path])
    assert piped.stderr.splitlines()[1] == ("the terminal map is left out beside --png for a mask of 4,096 x 4,096: "
                                            "the figure has it; run without --png to print the map too")


def test_an_option_of_another_command_says_which_command_takes_it():
    """`show causal --stages` offered '--as, --save, --sizes' (click's look-alikes), where --stages is attend's: the
    one line names the commands that take the option; a typo of the command's own options still gets click's guesses."""
    result = invoke(["show", "causal", "--len", "6", "--stages"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == ("maskcli: error: No such option: --stages (it is an option of maskcli attend) "
                             "(see 'maskcli show --help')\n")
    result = invoke(["kinds", "--len", "3"])
    assert result.exit_code == 2
    assert result.stderr.startswith("maskcli: error: No such option: --len (it is an option of maskcli show, chunk, blocks, diff, "
                                    "attend, verify, export and shard)")
    result = invoke(["show", "causal", "--lne", "3"])
    assert result.exit_code == 2
    assert result.stderr.startswith("maskcli: error: No such option: --lne (Possible options: --align, --kv-len, --len)")


def test_the_summary_wraps_between_words_on_a_narrow_terminal():
    """--summary was echoed as long lines that a 60-column terminal cut mid-word ('(0.01%) · ex' / 'act, from key
    intervals'); it wraps at spaces now, its indented lines under their indent."""
    text = ok(["show", "window(128)", "--len", "1048576", "--summary"], env={"COLUMNS": "60"}).stdout
    assert text.splitlines() == [
        "window(128) · shape (B=1, H=1, Lq=1048576, Lk=1048576)",
        "visible cells: 134,209,600 of 1,099,511,627,776 (0.01%) ·",
        "               exact, from key intervals",  # under its label's text, not at column 0
        "keys per query row: min 1 · median 128 · max 128",
        "rows that see no key: none",
        "attention FLOPs: 4·D per visible cell = 536,838,400·D, 0.01%",
        "                 of dense (4,398,046,511,104·D) for head",
        "                 size D",
    ]
    batched = ok(["show", "causal", "--len", "8", "--lengths", "5,3", "--heads", "2", "--summary"], env={"COLUMNS": "60"}).stdout
    assert "  keys per query row (every head's): min 1 · median 4.5 ·\n  max 5\n" in batched
    piped = ok(["show", "window(128)", "--len", "1048576", "--summary"]).stdout
    assert "visible cells: 134,209,600 of 1,099,511,627,776 (0.01%) · exact, from key intervals\n" in piped


def test_at_60_columns_the_header_wraps_between_its_parts_and_stands_in():
    """The header and legend wrapped at the last space that fit, to column 0: 'causal · shape (B=1, H=1, Lq=2, Lk=6) ·
    queries 4-5 · keys' then '0-5' alone, read as a row of the table; 'shape (B=1, H=1, Lq=5,' / 'Lk=5)'. They
    wrap between their ' · ' parts now, further lines two cells in."""
    def head(*args):
        return ok(["show", *args], env={"COLUMNS": "60"}).stdout.splitlines()

    assert head("prefill", "--offset", "4", "--len", "2")[:3] == [
        "causal · shape (B=1, H=1, Lq=2, Lk=6) · queries 4-5 ·",
        "  keys 0-5",
        "convention: keep (bool, 1 = True = may attend, 0 = masked)",
    ]
    assert head("document(0,0,1,1,1) & window(2)")[:5] == [
        "document(0,0,1,1,1) & window(2) ·",
        "  shape (B=1, H=1, Lq=5, Lk=5)",
        "convention: keep (bool, 1 = True = may attend, 0 = masked)",
        "│ ─ doc boundaries (labels above the keys, beside the",
        "  queries) · underlined: the diagonal",
    ]
    wide = ok(["show", "document(0,0,1,1,1) & window(2)"], env={"COLUMNS": "120"}).stdout.splitlines()
    assert wide[0] == "document(0,0,1,1,1) & window(2) · shape (B=1, H=1, Lq=5, Lk=5)"
    assert wide[2] == "│ ─ doc boundaries (labels above the keys, beside the queries) · underlined: the diagonal"


def test_control_characters_in_tokens_are_shown_escaped_not_sent_to_the_terminal(tmp_path):
    """Hunt 9b: a word of --tokens (or of its .json file) holding ESC[31m recoloured the terminal, a newline broke the
    table's row: they are shown as Python writes them, \\x1b and \\n."""
    (tmp_path / "words.json").write_text(json.dumps(["\x1b[31mred", "a\nb", "c", "d"]))
    for given in ("\x1b[31mred a\x07 c d", str(tmp_path / "words.json")):
        result = invoke(["show", "causal", "--len", "4", "--tokens", given])
        assert result.exit_code == 0 and "\x1b" not in result.stdout and "\x07" not in result.stdout
        assert "\\x1b[31mred" in result.stdout
    assert "a\\nb" in result.stdout
