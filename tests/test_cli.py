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
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from maskcli import masks
from maskcli.cli import app
from reference import KINDS, as_ints, expected_params, reference, valid_from_ids, valid_from_lengths

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


def table_rows(text):
    """The body rows of every table in the output (lines that start with a query position)."""
    return [line for line in lines(text) if re.match(r"-?\d+ ", line)]


# --- the table ----------------------------------------------------------------------


def test_show_causal_len_6_is_the_lower_triangular_table():
    result = ok(["show", "causal", "--len", "6"])
    assert lines(result.stdout) == [
        "causal len=6 · shape (B=1, H=1, Lq=6, Lk=6)",
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


def test_chunk_table_is_the_tutorial_mask():
    result = ok(["chunk", "0,0,1,1,2"])
    assert lines(result.stdout)[0] == "chunk chunks=0,0,1,1,2 · shape (B=1, H=1, Lq=5, Lk=5)"
    assert table_rows(result.stdout) == [
        "0 1 1 0 0 0",
        "1 1 1 0 0 0",
        "2 1 1 1 1 0",
        "3 1 1 1 1 0",
        "4 1 1 1 1 1",
    ]


def test_prefill_rows_are_absolute_query_positions():
    result = ok(["show", "prefill", "--offset", "4", "--len", "2"])
    assert "(B=1, H=1, Lq=2, Lk=6)" in result.stdout
    assert table_rows(result.stdout) == ["4 1 1 1 1 1 0", "5 1 1 1 1 1 1"]


def test_padding_prints_one_table_per_batch_row():
    result = ok(["show", "padding", "--lengths", "4,2"])
    out = lines(result.stdout)
    assert out[0] == "padding len=4 lengths=4,2 · shape (B=2, H=1, Lq=4, Lk=4)"
    assert "batch 0 (length 4)" in out and "batch 1 (length 2)" in out
    assert table_rows(result.stdout) == ["0 1 1 1 1", "1 1 1 1 1", "2 1 1 1 1", "3 1 1 1 1", "0 1 1 0 0", "1 1 1 0 0", "2 1 1 0 0", "3 1 1 0 0"]


def test_padding_from_ids():
    result = ok(["show", "padding", "--ids", "5,6,0;7,0,0", "--pad-id", "0"])
    assert table_rows(result.stdout) == ["0 1 1 0", "1 1 1 0", "2 1 1 0", "0 1 0 0", "1 1 0 0", "2 1 0 0"]


@pytest.mark.parametrize("convention, dtype, visible, masked, described", [
    ("keep", "float32", "1", "0", "keep (bool, 1 = True = may attend, 0 = masked)"),
    ("block", "float32", "False", "True", "block (False = may attend, True = masked)"),
    ("additive", "float32", "0", "-inf", "additive float32 (0 = may attend, -inf = masked)"),
    ("min", "float32", "0", "-3.4e+38", "min float32 (0 = may attend, -3.4e+38 = masked)"),
    ("min", "float16", "0", "-6.6e+04", "min float16 (0 = may attend, -6.6e+04 = masked)"),
    ("min", "bfloat16", "0", "-3.4e+38", "min bfloat16 (0 = may attend, -3.4e+38 = masked)"),
    ("int", "float32", "1", "0", "int (1 = may attend, 0 = masked)"),
])
def test_as_shows_each_conventions_symbols(convention, dtype, visible, masked, described):
    result = ok(["show", "causal", "--len", "3", "--as", convention, "--dtype", dtype])
    assert lines(result.stdout)[1] == f"convention: {described}"
    v, m = visible, masked
    assert table_rows(result.stdout) == [f"0 {v} {m} {m}", f"1 {v} {v} {m}", f"2 {v} {v} {v}"]


def test_tokens_label_both_axes():
    result = ok(["show", "causal", "--len", "3", "--tokens", "Your journey starts"])
    out = lines(result.stdout)
    assert "q \\ kv Your journey starts" in out
    assert table_rows(result.stdout) == ["0 Your 1 0 0", "1 journey 1 1 0", "2 starts 1 1 1"]


def test_tokens_with_prefill_label_rows_by_their_absolute_position():
    result = ok(["show", "prefill", "--offset", "2", "--len", "2", "--tokens", "a b c d"])
    assert "q \\ kv a b c d" in lines(result.stdout)
    assert table_rows(result.stdout) == ["2 c 1 1 1 0", "3 d 1 1 1 1"]


def test_heads_are_shown_once_when_identical():
    result = ok(["show", "causal", "--len", "2", "--heads", "3"])
    assert "(B=1, H=3, Lq=2, Lk=2)" in result.stdout
    assert table_rows(result.stdout) == ["0 1 0", "1 1 1"]


def test_labels_that_go_down_warn_on_stderr_and_still_show_the_mask():
    result = invoke(["chunk", "0,1,0"])
    assert result.exit_code == 0, result.output
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("maskcli: warning: chunk labels go down at position 2 (1 then 0)")
    assert "warning" not in result.stdout
    labels = [0, 1, 0]
    assert table_rows(result.stdout) == [
        f"{q} " + " ".join(str(int(labels[kv] <= labels[q])) for kv in range(3)) for q in range(3)
    ]


def test_document_labels_going_down_do_not_warn():
    result = ok(["show", "document", "--chunks", "1,1,0"])
    assert result.stderr == ""


# --- density maps for wide masks -------------------------------------------------------


DENSITY = {"█": lambda s: s == 1, "·": lambda s: s == 0, "▓": lambda s: 0.5 < s < 1, "░": lambda s: 0 < s <= 0.5}


@pytest.mark.parametrize("args, kind, q_len, offset, params", [
    (["show", "causal", "--len", "300"], "causal", 300, 0, {}),
    (["show", "window", "--len", "300", "--window", "40"], "window", 300, 0, {"window": 40}),
    (["show", "prefill", "--offset", "100", "--len", "200"], "prefill", 200, 100, {}),
    (["show", "prefix", "--len", "250", "--prefix", "90"], "prefix", 250, 0, {"prefix": 90}),
])
def test_wide_mask_is_a_density_map(args, kind, q_len, offset, params):
    result = ok(args, env={"COLUMNS": "80"})
    text = " ".join(result.stdout.split())
    assert "one character =" in text and "█ all visible ▓ over half ░ some · none" in text
    assert all(len(line) <= 80 for line in result.stdout.splitlines())
    found = re.search(r"one character = (\d+) quer(?:y|ies) x (\d+) keys?", text)
    rows, cols = int(found[1]), int(found[2])
    assert "estimated" not in text  # blocks this small are counted exactly
    k_len = q_len + offset
    keep = reference(kind, q_len, k_len, offset, **params)[0][0]
    body = [line.split() for line in result.stdout.splitlines() if re.fullmatch(r"\s*\d+ [█▓░·]+", line)]
    check_ruler(result.stdout, cols)
    assert len(body) == -(-q_len // rows)
    for r, (label, chars) in enumerate(body):
        assert int(label) == offset + r * rows  # labelled by the block's first absolute query position
        assert len(chars) == -(-k_len // cols)
        for c, char in enumerate(chars):
            block = [keep[i][j] for i in range(r * rows, min(q_len, (r + 1) * rows))
                     for j in range(c * cols, min(k_len, (c + 1) * cols))]
            share = sum(block) / len(block)
            assert DENSITY[char](share), (r, c, char, share)


def check_ruler(stdout, cols):
    """Every number on the key ruler stands over the column whose first key it names, apart from its neighbours."""
    out = stdout.splitlines()
    first = next(i for i, line in enumerate(out) if re.fullmatch(r"\s*\d+ [█▓░·]+", line))
    start = len(out[first]) - len(out[first].lstrip()) + len(out[first].split()[0]) + 1  # where the map's cells begin
    marks = list(re.finditer(r"\d+", out[first - 1]))
    assert marks and int(marks[0][0]) == 0 and marks[0].start() == start
    for mark in marks:
        assert int(mark[0]) == (mark.start() - start) * cols, out[first - 1]
    assert all(b.start() > a.end() for a, b in zip(marks, marks[1:]))


def test_a_very_long_mask_is_summarised_without_materialising_it():
    result = ok(["show", "causal", "--len", "100000"], env={"COLUMNS": "80"})
    text = " ".join(result.stdout.split())
    assert "one character =" in text and "Lq=100000, Lk=100000" in text
    cols = int(re.search(r"one character = \d+ queries x (\d+) keys", text)[1])
    check_ruler(result.stdout, cols)


def test_the_longest_mask_has_a_readable_ruler():
    length = 1 << 40
    result = ok(["show", "causal", "--len", length], env={"COLUMNS": "80"})
    text = " ".join(result.stdout.split())
    cols = int(re.search(r"one character = \d+ queries x (\d+) keys", text)[1])
    check_ruler(result.stdout, cols)


def test_density_map_per_batch_row():
    result = ok(["show", "causal", "--len", "300", "--lengths", "300,100"], env={"COLUMNS": "80"})
    assert result.stdout.count("one character =") == 2
    assert "batch 0 (length 300)" in result.stdout and "batch 1 (length 100)" in result.stdout


# --- JSON equals the definitions ------------------------------------------------------


def draw_case(data, kind):
    """Random options for `kind`: the argv, and what --json must then say."""
    draw = data.draw
    args, rule_params, opts = ["show", kind], {}, {}
    offset, labels, give_len = 0, None, True
    if kind in ("chunk", "document"):
        labels = draw(st.lists(st.integers(-2, 5), min_size=1, max_size=9))
        args += ["--chunks", ",".join(map(str, labels))]
        q_len, give_len = len(labels), False
        rule_params["labels"] = labels
    else:
        q_len = draw(st.integers(1, 9))
    if kind == "prefill":
        offset = draw(st.integers(0, 6))
        args += ["--offset", offset]
    if kind in ("tril", "triu"):
        diagonal = draw(st.none() | st.integers(-4, 4))
        means = draw(st.sampled_from([None, "keep", "block"]))
        args += [] if diagonal is None else ["--diagonal", diagonal]
        args += [] if means is None else ["--means", means]
        rule_params.update(diagonal=diagonal, means=means)
        opts.update(diagonal=diagonal, means=means)
    if kind == "window":
        rule_params["window"] = opts["window"] = draw(st.integers(1, 10))
        args += ["--window", opts["window"]]
    if kind == "prefix":
        rule_params["prefix"] = opts["prefix"] = draw(st.integers(1, q_len + offset))
        args += ["--prefix", opts["prefix"]]
    k_len = q_len + offset
    padding = draw(st.sampled_from(["lengths", "ids"] if kind == "padding" else [None, "lengths", "ids"]))
    valid = None
    if padding == "lengths":
        lengths = draw(st.lists(st.integers(0, k_len), min_size=1, max_size=3))
        args += ["--lengths", ",".join(map(str, lengths))]
        valid, opts["lengths"] = valid_from_lengths(lengths, k_len), lengths
        if max(lengths) == k_len and labels is None and draw(st.booleans()):
            give_len = False  # the longest length is the sequence length
    elif padding == "ids":
        ids = draw(st.lists(st.lists(st.integers(0, 3), min_size=k_len, max_size=k_len), min_size=1, max_size=3))
        pad_id = draw(st.integers(0, 3))
        args += ["--ids", ";".join(",".join(map(str, row)) for row in ids), "--pad-id", pad_id]
        valid, opts["ids"], opts["pad_id"] = valid_from_ids(ids, pad_id), ids, pad_id
        give_len = give_len and draw(st.booleans())
    if give_len:
        args += ["--len", q_len]
    heads = draw(st.integers(1, 2))
    if heads != 1:
        args += ["--heads", heads]
    args += ["--as", draw(st.sampled_from(["keep", "block", "additive", "min", "int"]))]  # --json is keep whatever --as says
    expected = {
        "kind": kind,
        "params": expected_params(kind, q_len=q_len, offset=offset, labels=labels, heads=heads, **opts),
        "shape": [1 if valid is None else len(valid), heads, q_len, k_len],
        "q_offset": offset,
        "convention": "keep",
        "mask": as_ints(reference(kind, q_len, k_len, offset, valid=valid, heads=heads, **rule_params)),
    }
    return args, expected


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_json_of_every_kind_equals_the_definition(kind, data):
    args, expected = draw_case(data, kind)
    result = ok([*args, "--json"])
    got = json.loads(result.stdout)
    assert {key: got[key] for key in expected} == expected, args


@settings(max_examples=15, deadline=None)
@given(labels=st.lists(st.integers(0, 6), min_size=1, max_size=10))
def test_chunk_command_json_equals_the_definition(labels):
    text = ",".join(map(str, labels))
    got = json.loads(ok(["chunk", text, "--json"]).stdout)
    n = len(labels)
    assert got["kind"] == "chunk" and got["params"] == {"chunks": labels} and got["convention"] == "keep"
    assert got["shape"] == [1, 1, n, n] and got["q_offset"] == 0
    assert got["mask"] == [[[[int(labels[kv] <= labels[q]) for kv in range(n)] for q in range(n)]]]


def test_chunk_json_is_the_tutorial_matrix():
    got = json.loads(ok(["chunk", "0,0,1,1,1,1,2,2,2,3,4,4", "--json"]).stdout)
    assert got["kind"] == "chunk" and got["convention"] == "keep" and got["q_offset"] == 0
    assert got["shape"] == [1, 1, 12, 12]
    assert got["mask"] == [[[
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]]]


def test_json_is_one_object_and_carries_tokens():
    result = ok(["show", "causal", "--len", "2", "--tokens", "hello world", "--json"])
    got = json.loads(result.stdout)  # nothing but the object on stdout
    assert got["tokens"] == ["hello", "world"] and got["mask"] == [[[[1, 0], [1, 1]]]]


# --- saved tensors -------------------------------------------------------------------


def expected_tensor_values(convention, dtype):
    """causal --len 4 --lengths 4,2 in `convention`, from the definition."""
    keep = reference("causal", 4, 4, valid=valid_from_lengths([4, 2], 4))
    fill = {"additive": -math.inf, "min": float(torch.finfo(dtype).min) if dtype.is_floating_point else None}.get(convention)

    def cell(k):
        return {"keep": k, "block": not k, "int": int(k)}.get(convention, 0.0 if k else fill)

    return [[[[cell(k) for k in row] for row in plane] for plane in b] for b in keep]


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
    base = ["show", "causal", "--len", "4", "--lengths", "4,2", "--as", convention, "--dtype", dtype_name]
    want = expected_tensor_values(convention, torch_dtype)
    pt = tmp_path / "mask.pt"
    result = ok([*base, "--save", pt])
    assert f"wrote {pt} ({convention} convention)" in result.stderr
    saved = torch.load(pt, weights_only=True)
    assert saved.dtype == torch_dtype and tuple(saved.shape) == (2, 1, 4, 4)
    assert saved.tolist() == want
    if numpy_dtype is None:
        return
    npy = tmp_path / "mask.npy"
    ok([*base, "--save", npy])
    loaded = np.load(npy, allow_pickle=False)
    assert loaded.dtype == numpy_dtype and loaded.shape == (2, 1, 4, 4)
    assert loaded.tolist() == want


def test_save_with_json_writes_the_file_and_prints_keep(tmp_path):
    path = tmp_path / "m.npy"
    got = json.loads(ok(["show", "window", "--len", "3", "--window", "2", "--as", "block", "--save", path, "--json"]).stdout)
    assert got["mask"] == [[[[1, 0, 0], [1, 1, 0], [0, 1, 1]]]]
    assert np.load(path).tolist() == [[[[False, True, True], [False, False, True], [True, False, False]]]]


# --- bad input ----------------------------------------------------------------------


BAD = [
    # labels that are not integers
    (["chunk", "0,a,1", "--save", "m.pt"], ["'a'", "position 1"]),
    (["chunk", "0,1,2.5", "--png", "m.png"], ["'2.5'", "position 2"]),
    (["show", "document", "--chunks", "0;1", "--json"], ["'0;1'"]),
    # empty labels
    (["chunk", "", "--save", "m.pt"], ["empty"]),
    (["chunk", " , ", "--png", "m.png"], ["empty"]),
    # --len zero or negative (or not a number)
    (["show", "causal", "--len", "0", "--save", "m.pt"], ["--len", "got 0"]),
    (["show", "causal", "--len", "-2", "--png", "m.png"], ["--len", "got -2"]),
    (["show", "causal", "--len", "six"], ["'six'"]),
    # a length larger than --len
    (["show", "padding", "--lengths", "3,7", "--len", "5", "--save", "m.pt"], ["length 7", "'3,7'", "5"]),
    (["show", "causal", "--lengths", "9", "--len", "4", "--png", "m.png"], ["length 9", "4"]),
    (["show", "padding", "--ids", "1,2,0", "--len", "4"], ["3 tokens", "4 positions"]),
    # a --tokens count that does not match
    (["show", "causal", "--len", "3", "--tokens", "a b", "--save", "m.npy"], ["2 words", "3 key positions"]),
    (["chunk", "0,0,1", "--tokens", "one two three four"], ["4 words", "3 key positions"]),
    # a window or prefix < 1
    (["show", "window", "--len", "4", "--window", "0", "--png", "m.png"], ["--window", "got 0"]),
    (["show", "window", "--len", "4", "--window", "-3"], ["--window", "got -3"]),
    (["show", "prefix", "--len", "4", "--prefix", "0", "--save", "m.pt"], ["--prefix", "got 0"]),
    (["show", "prefix", "--len", "4", "--prefix", "5"], ["--prefix 5", "4 tokens"]),
    # an unknown kind
    (["show", "banana", "--save", "m.pt"], ["'banana'", ", ".join(KINDS)]),
    # an output directory that does not exist
    (["show", "causal", "--png", "missing/m.png"], ["'missing'"]),
    (["show", "causal", "--save", "missing/deeper/m.pt"], ["'missing/deeper'"]),
    # an unknown output extension
    (["show", "causal", "--png", "m.gif"], ["'.gif'", ".png, .svg, .pdf"]),
    (["show", "causal", "--save", "m.txt"], ["'.txt'", ".pt, .npy"]),
    (["chunk", "0,1", "--save", "m"], ["'m'", ".pt, .npy"]),
    # a dense mask that would not fit in memory: say how many bytes
    (["show", "causal", "--len", "3000000", "--json"], [f"({3_000_000**2 * 12:,} bytes)"]),
    (["show", "causal", "--len", "3000000", "--save", "m.pt"], [f"({3_000_000**2 * 2:,} bytes)"]),
    # other choices
    (["show", "causal", "--as", "sideways"], ["'sideways'", "keep, block, additive, min, int"]),
    (["show", "causal", "--as", "min", "--dtype", "float8"], ["'float8'"]),
    (["show", "causal", "--as", "min", "--dtype", "bfloat16", "--save", "m.npy"], ["bfloat16", ".npy"]),
    (["show", "tril", "--means", "both"], ["'both'"]),
    (["show", "causal", "--window", "3"], ["--window 3", "'causal'"]),
    (["show", "padding"], ["--lengths"]),
    (["show", "padding", "--ids", "1,2;3"], ["'1,2;3'"]),
    (["chunk", "0,1", "--len", "2"], ["--len"]),
    (["show"], ["Missing argument", "'kind'"]),
]


@pytest.mark.parametrize("args, quoted", BAD, ids=[" ".join(args) for args, _ in BAD])
def test_bad_input_is_one_line_exit_2_no_traceback_no_file(args, quoted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(masks, "available_memory", lambda device=None: 16 << 30)  # the same answer on every machine
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an escaped exception
    assert result.stderr.endswith("\n")
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ")
    for text in quoted:
        assert text in line
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_png_onto_a_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.png").mkdir()
    result = invoke(["show", "causal", "--png", "out.png"])
    assert result.exit_code == 2 and result.stderr.startswith("maskcli: error: --png 'out.png' is a directory")
    assert list((tmp_path / "out.png").iterdir()) == []


# --- help and imports ----------------------------------------------------------------


def test_help_ends_with_examples_and_says_how_window_counts():
    text = " ".join(ok(["show", "--help"]).stdout.replace("│", " ").split())
    assert "maskcli show causal --len 6" in text
    assert "W-1 keys before it" in text and "W keys in all" in text
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
    for args in (["--help"], ["show", "--help"]):
        names, stdout = imported_modules(*args)
        assert "Usage" in stdout
        assert "torch" not in names and "matplotlib" not in names, args


def test_a_table_imports_no_matplotlib():
    names, stdout = imported_modules("show", "causal", "--len", "6")
    assert "torch" in names  # the check can see what it looks for
    assert "matplotlib" not in names
    assert table_rows(stdout)[-1] == "5 1 1 1 1 1 1"
