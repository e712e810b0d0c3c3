"""`maskcli show` and `maskcli chunk` through Typer's CliRunner, with the expected text written here."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.cli import app

runner = CliRunner()


def ok(args, **kwargs):
    result = runner.invoke(app, args, **kwargs)
    assert result.exit_code == 0, result.output
    return result


def rows(output):
    """The table's body rows, whitespace-normalised."""
    return [" ".join(line.split()) for line in output.splitlines() if line.strip()[:1].isdigit()]


def test_show_causal_prints_a_lower_triangular_table():
    result = ok(["show", "causal", "--len", "6"])
    assert "causal len=6" in result.stdout and "(B=1, H=1, Lq=6, Lk=6)" in result.stdout
    assert "convention: keep" in result.stdout
    assert rows(result.stdout) == [
        "0 1 0 0 0 0 0",
        "1 1 1 0 0 0 0",
        "2 1 1 1 0 0 0",
        "3 1 1 1 1 0 0",
        "4 1 1 1 1 1 0",
        "5 1 1 1 1 1 1",
    ]


@pytest.mark.parametrize(
    "convention, expected",
    [
        ("block", ["0 False True True", "1 False False True", "2 False False False"]),
        ("additive", ["0 0 -inf -inf", "1 0 0 -inf", "2 0 0 0"]),
        ("min", ["0 0 -3.4e+38 -3.4e+38", "1 0 0 -3.4e+38", "2 0 0 0"]),
        ("int", ["0 1 0 0", "1 1 1 0", "2 1 1 1"]),
    ],
)
def test_as_picks_the_convention_shown(convention, expected):
    result = ok(["show", "causal", "--len", "3", "--as", convention])
    assert rows(result.stdout) == expected
    assert f"convention: {convention}" in result.stdout


def test_prefill_rows_are_absolute_positions_and_tokens_label_axes():
    result = ok(["show", "prefill", "--offset", "3", "--len", "2", "--tokens", "a b c d e"])
    assert rows(result.stdout) == ["3 d 1 1 1 1 0", "4 e 1 1 1 1 1"]
    assert "a  b  c  d  e" in result.stdout.replace("   ", "  ")


def test_padding_shows_one_table_per_batch_row():
    result = ok(["show", "padding", "--lengths", "3,1"])
    assert "batch 0 (length 3)" in result.stdout and "batch 1 (length 1)" in result.stdout
    assert rows(result.stdout) == ["0 1 1 1", "1 1 1 1", "2 1 1 1", "0 1 0 0", "1 1 0 0", "2 1 0 0"]


def test_wide_mask_prints_a_density_map_with_a_legend():
    result = ok(["show", "causal", "--len", "400"], env={"COLUMNS": "80"})
    assert "one character = " in result.stdout and "█ all visible" in result.stdout
    body = [line for line in result.stdout.splitlines() if "█" in line and "visible" not in line]
    assert body and all(len(line) <= 80 for line in result.stdout.splitlines())
    first, last = body[0], body[-1]
    assert "·" in first and "·" not in last.split(" ", 1)[1].strip()  # the last block row sees almost everything


TUTORIAL_CHUNK = [  # labels 0,0,1,1,1,1,2,2,2,3,4,4: own chunk and every earlier chunk
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
]


def test_chunk_json_is_the_tutorial_matrix():
    data = json.loads(ok(["chunk", "0,0,1,1,1,1,2,2,2,3,4,4", "--json"]).stdout)
    assert data["kind"] == "chunk" and data["shape"] == [1, 1, 12, 12] and data["q_offset"] == 0
    assert data["convention"] == "keep" and data["params"]["chunks"] == [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4]
    assert data["mask"] == [[TUTORIAL_CHUNK]]


JSON_CASES = [
    (["show", "causal", "--len", "5"], lambda b, q, kv: kv <= q, 5, 0),
    (["show", "prefill", "--offset", "4", "--len", "3"], lambda b, q, kv: kv <= q, 3, 4),
    (["show", "window", "--len", "7", "--window", "3"], lambda b, q, kv: kv <= q < kv + 3, 7, 0),
    (["show", "prefix", "--len", "6", "--prefix", "2"], lambda b, q, kv: kv <= q or kv < 2, 6, 0),
    (["show", "document", "--chunks", "0,0,1,1,1,2"], lambda b, q, kv: [0, 0, 1, 1, 1, 2][q] == [0, 0, 1, 1, 1, 2][kv] and kv <= q, 6, 0),
    (["show", "padding", "--lengths", "4,2", "--len", "5"], lambda b, q, kv: kv < [4, 2][b], 5, 0),
    (["show", "causal", "--lengths", "3,5"], lambda b, q, kv: kv <= q and kv < [3, 5][b], 5, 0),
    (["show", "padding", "--ids", "0,7,8;5,6,0", "--pad-id", "0"], lambda b, q, kv: [[0, 7, 8], [5, 6, 0]][b][kv] != 0, 3, 0),
    (["show", "tril", "--len", "4", "--diagonal", "1"], lambda b, q, kv: kv - q <= 1, 4, 0),
    (["show", "triu", "--len", "4", "--diagonal", "0"], lambda b, q, kv: kv < q, 4, 0),
]


@pytest.mark.parametrize("args, rule, q_len, offset", JSON_CASES, ids=lambda case: " ".join(case) if isinstance(case, list) else None)
def test_json_mask_equals_the_definition(args, rule, q_len, offset):
    data = json.loads(ok([*args, "--json", "--as", "block"]).stdout)  # --as never changes the JSON's polarity
    batch, heads, lq, lk = data["shape"]
    assert (lq, lk, data["q_offset"]) == (q_len, q_len + offset, offset)
    expected = [[[[int(rule(b, offset + i, j)) for j in range(lk)] for i in range(lq)]] * heads for b in range(batch)]
    assert data["mask"] == expected


def test_save_pt_and_npy_in_the_as_convention(tmp_path):
    ok(["show", "causal", "--len", "4", "--as", "additive", "--save", str(tmp_path / "m.pt")])
    saved = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(saved[0, 0], torch.nn.Transformer.generate_square_subsequent_mask(4))
    ok(["show", "causal", "--len", "4", "--as", "block", "--save", str(tmp_path / "m.npy")])
    assert np.array_equal(np.load(tmp_path / "m.npy")[0, 0], ~np.tril(np.ones((4, 4), dtype=bool)))


def test_labels_that_go_down_warn_but_work():
    result = runner.invoke(app, ["chunk", "0,1,0"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("maskcli: warning: chunk labels go down at position 2")


BAD = [
    (["chunk", "0,a,1"], "'a'"),
    (["chunk", ""], "empty"),
    (["chunk", " , "], "empty"),
    (["show", "causal", "--len", "0"], "got 0"),
    (["show", "causal", "--len", "-3"], "got -3"),
    (["show", "causal", "--len", "x"], "'x'"),
    (["show", "padding", "--lengths", "9", "--len", "4"], "length 9"),
    (["show", "causal", "--len", "3", "--tokens", "a b"], "2 words"),
    (["show", "window", "--window", "0"], "got 0"),
    (["show", "prefix", "--prefix", "0"], "got 0"),
    (["show", "banana"], "'banana'"),
    (["show", "causal", "--png", "no/such/dir/m.png"], "'no/such/dir'"),
    (["show", "causal", "--png", "m.gif"], "'.gif'"),
    (["show", "causal", "--save", "m.txt"], "'.txt'"),
    (["show", "causal", "--len", "3000000", "--json"], "bytes"),
    (["show", "causal", "--as", "upside-down"], "'upside-down'"),
]


@pytest.mark.parametrize("args, quoted", BAD, ids=lambda case: " ".join(case) if isinstance(case, list) else None)
def test_bad_input_is_one_line_exit_2_and_no_file(args, quoted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error: "), result.stderr
    assert quoted in lines[0]
    assert "Traceback" not in result.output and result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_unknown_kind_lists_the_kinds():
    result = runner.invoke(app, ["show", "banana"])
    assert "causal, tril, triu, padding, prefill, chunk, window, prefix, document" in result.stderr


def test_too_big_mask_says_how_many_bytes():
    result = runner.invoke(app, ["show", "causal", "--len", "3000000", "--json"])
    assert "(108,000,000,000,000 bytes)" in result.stderr  # 9e12 cells x 12 bytes of JSON each


def imported(args):
    code = (
        "import sys; from maskcli.cli import main; sys.argv = ['maskcli', *%r]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'matplotlib') if m in sys.modules), file=sys.stderr)" % (args,)
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return result.stderr.rsplit("HEAVY", 1)[1].strip()


def test_help_imports_neither_torch_nor_matplotlib_and_a_table_no_matplotlib():
    assert imported(["--help"]) == "[]"
    assert imported(["show", "--help"]) == "[]"
    assert imported(["show", "causal", "--len", "6"]) == "['torch']"


def test_save_refuses_a_tensor_bigger_than_the_free_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))  # 100 bytes free
    path = tmp_path / "big.pt"
    result = runner.invoke(app, ["show", "causal", "--len", "16", "--save", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"maskcli: error: --save {str(path)!r} would write 256 bytes but the disk there has 100 bytes free: use a smaller --len, or --png for a picture of it\n"
    assert not path.exists()


def test_dtype_with_a_bool_or_int_convention_is_said_to_be_ignored():
    result = runner.invoke(app, ["show", "causal", "--len", "2", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "maskcli: warning: --dtype float16 is ignored: it is for --as additive and --as min, and --as keep has a dtype of its own\n"
    quiet = runner.invoke(app, ["show", "causal", "--len", "2", "--as", "min", "--dtype", "float16"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
    assert "convention: min float16" in quiet.stdout
