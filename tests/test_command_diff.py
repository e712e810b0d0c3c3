"""`maskcli diff A B` against a double loop, with expressions, tensor files and mask_mods on either side."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

import definitions as ref
import maskfiles
from maskcli.commands import app
from strategies import cases, expected_cells

runner = CliRunner()
GYM = str(Path(__file__).parent / "data" / "gym_masks.py")
FLAGS = {"length": "--len", "offset": "--offset", "kv_start": "--kv-start", "kv_len": "--kv-len", "align": "--align",
         "lengths": "--lengths", "ids": "--ids"}


def diff(*args, **kwargs):
    return runner.invoke(app, ["diff", *map(str, args)], **kwargs)


def as_json(*args):
    result = diff(*args, "--json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert result.exit_code == (0 if data["equal"] else 1)
    return data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(first=cases(), second=cases())
def test_counts_and_rows_equal_a_double_loop(first, second):
    tree_a, options, frame, valid = first
    tree_b = second[0]
    args = [ref.text(tree_a), ref.text(tree_b)]
    for key, flag in FLAGS.items():
        if options.get(key) is not None:
            args += [flag, options[key]]
    result = diff(*args, "--json")
    if result.exit_code == 2:  # the second tree's labels may not fit the first's positions
        assert "maskcli: error:" in result.stderr
        return
    data = json.loads(result.stdout)
    batch = max(data["a"]["shape"][0], data["b"]["shape"][0])
    a = expected_cells(tree_a, options, frame, valid, batch)
    b = expected_cells(tree_b, options, frame, valid, batch)
    assert (data["only_a"], data["only_b"], data["both"]) == (int((a & ~b).sum()), int((b & ~a).sum()), int((a & b).sum()))
    differing = [(bi, q) for bi in range(batch) for q in range(frame[1]) if (a[bi, q] != b[bi, q]).any()]
    assert [(r["batch"], r["query"] - frame[0]) for r in data["rows"]] == differing[:5]
    assert result.exit_code == (0 if not differing else 1)


def test_words_name_the_keys_one_side_hides():
    result = diff("window(3)", "window(4)", "--len", 6)
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())
    assert "only A allows 0 cells · only B allows 3 · both allow 15" in text
    assert "row 3: A sees 1-3, B sees 0-3: A hides key 0" in text
    assert "row 5: A sees 3-5, B sees 2-5: A hides key 2" in text
    leak = diff("document(0,0,1,1)", "causal")
    assert leak.exit_code == 1 and "row 2: A sees 2, B sees 0-2: A hides keys 0-1" in " ".join(leak.stdout.split())


def test_equal_masks_exit_0():
    result = diff("causal", "tril(0)", "--len", 5)
    assert result.exit_code == 0 and "equal (exact, from key intervals)" in result.stdout
    assert diff("~triu(1, means=keep)", "causal", "--len", 7).exit_code == 0


def test_exact_at_a_million_tokens():
    data = as_json("window(4095)", "window(4096)", "--len", 1 << 20)
    n = 1 << 20
    assert data["only_a"] == 0 and data["only_b"] == n - 4095 and data["counted"] == "exact, from key intervals"
    assert data["words"][0] == "row 4095: A sees 1-4095, B sees 0-4095: A hides key 0"


def test_a_tensor_file_places_the_expression_beside_it(tmp_path):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6)  # PyTorch's additive causal mask
    torch.save(mask, tmp_path / "square.pt")
    assert diff("causal", tmp_path / "square.pt").exit_code == 0
    data = as_json("window(3)", tmp_path / "square.pt")
    assert data["only_b"] == sum(max(0, q - 2) for q in range(6))
    # Hugging Face style: a 4-D float mask, min where masked, two new queries behind four cached keys
    keep = torch.ones(2, 6, dtype=torch.bool).tril(4)
    hf = torch.zeros(1, 1, 2, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    np.save(tmp_path / "hf.npy", hf.numpy())
    assert diff("causal", tmp_path / "hf.npy").exit_code == 0  # the queries sit at the end of the keys
    off = as_json(tmp_path / "hf.npy", "window(2)")
    assert off["only_a"] == 3 + 4


def test_two_files_and_a_padded_or_placed_expression_beside_a_file(tmp_path):
    torch.save(torch.nn.Transformer.generate_square_subsequent_mask(6), tmp_path / "square.pt")  # additive
    torch.save(torch.tril(torch.ones(6, 6)), tmp_path / "tril.pt")  # the tutorial's 0/1
    torch.save(torch.ones(6, 6, dtype=torch.bool).triu(2), tmp_path / "wide.pt")  # block, as MHA takes it
    assert diff(tmp_path / "square.pt", tmp_path / "tril.pt").exit_code == 0
    files = as_json(tmp_path / "tril.pt", tmp_path / "wide.pt")
    assert files["only_b"] == 5  # the block mask triu(2) keeps the diagonal after the main one too
    # Hugging Face left padding: (B, 1, Lq, Lk) with min on masked cells; --ids pads the expression only
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    keep[1, :, :, :3] = False
    hf = torch.zeros(2, 1, 8, 8).masked_fill(~keep, torch.finfo(torch.float32).min)
    torch.save(hf, tmp_path / "left.pt")
    assert diff("causal", tmp_path / "left.pt", "--ids", "1,1,1,1,1,1,1,1;0,0,0,1,1,1,1,1").exit_code == 0
    assert diff("causal", tmp_path / "left.pt", "--lengths", "8,8").exit_code == 1
    # a window behind a cache: four new queries after ten cached keys, placed by --offset and --len or by the file
    q, k = torch.arange(10, 14)[:, None], torch.arange(14)[None]
    torch.save(torch.where((k <= q) & (q - k < 4), 0.0, float("-inf")), tmp_path / "cache.pt")
    assert diff("window(4)", tmp_path / "cache.pt", "--offset", 10, "--len", 4).exit_code == 0
    assert diff("window(4)", tmp_path / "cache.pt", "--offset", 10).exit_code == 0
    assert diff("window(4)", tmp_path / "cache.pt").exit_code == 0


def test_a_mask_mod_from_a_package_in_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "mymasks").mkdir()
    (tmp_path / "mymasks" / "__init__.py").write_text("")
    (tmp_path / "mymasks" / "gym.py").write_text(Path(GYM).read_text())
    monkeypatch.chdir(tmp_path)
    assert diff("mymasks.gym:causal_mask", "causal", "--len", 5, "--mask-mod", "mymasks.gym:causal_mask").exit_code == 0


def test_a_mask_mod_on_either_side(tmp_path):
    assert diff(f"{GYM}:causal_mask", "causal", "--len", 5, "--mask-mod", f"{GYM}:causal_mask").exit_code == 0
    assert diff("causal", "causal_mask", "--len", 5, "--mask-mod", f"{GYM}:causal_mask").exit_code == 0
    data = as_json("window(3)", "generate_sliding_window", "--mask-mod", f"{GYM}:generate_sliding_window", "--mask-mod-args", 3, "--len", 7)
    assert data["b"]["expression"] == "generate_sliding_window" and data["only_b"] == 4  # its window 3 is maskcli's window(4)
    both = as_json("causal_mask & ~window(2)", "causal", "--mask-mod", f"{GYM}:causal_mask", "--len", 5)
    assert both["only_b"] == 5 + 4  # the diagonal and the one before it


def test_maps_and_figures(tmp_path):
    result = diff("window(100)", "window(101)", "--len", 5000, env={"COLUMNS": "80"})
    assert result.exit_code == 1
    map_rows = [line.split()[-1] for line in result.stdout.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 2]
    assert map_rows and all("B" in row for row in map_rows[1:])  # every block row past the first holds a key only B allows
    assert "one character =" in result.stdout
    png = tmp_path / "leak.png"
    assert diff("document(0,0,1,1)", "causal", "--png", png).exit_code == 1
    assert png.stat().st_size > 0


@pytest.mark.parametrize("args, says", [
    (["causal", "window(2)", "--mask", "m.pt"], "give the file as one of them instead of --mask"),
    (["causal", "missing.pt"], "no such file"),
    (["causal", "document(0,1,1)", "--len", "5"], "have 3 entries but the mask covers positions 0-4"),
    (["windw(3)", "causal"], "did you mean window?"),
    (["causal", "evilmod:f"], "B 'evilmod:f' looks like a mask_mod: loading one runs its code, so only --mask-mod loads it: "
                              "give --mask-mod evilmod:f and write B as f"),
    (["this:f", "causal"], "give --mask-mod this:f and write A as f"),
    (["causal", "evilmod:f", "--mask-mod", "other.py:g"], "B 'evilmod:f' names a mask_mod that --mask-mod 'other.py:g' does not load"),
    (["causal", "window(2)", "--mask-mod-args", "3"], "--mask-mod-args is for --mask-mod"),
    (["causal", "window(2)", "--key", "nan"], "--key nan is for a mask file"),  # (two expressions: it was dropped)
    (["causal", "window(2)", "--from", "additive"], "--from additive is for a mask file"),
])
def test_bad_input_is_one_line(args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evilmod.py").write_text("open('ran', 'w').close()\nf = lambda b, h, q, kv: kv <= q\n")
    result = diff(*args)
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "ran").exists()  # a side is never imported without --mask-mod


def test_tokens_label_the_diff_table_or_are_said_to_be_left_out():
    result = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "4", "--tokens", "alpha beta gamma delta"])
    assert result.exit_code == 1
    assert " q \\ kv   alpha  beta  gamma  delta\n" in result.stdout and " 3 delta    A     1      1      1\n" in result.stdout
    narrow = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "4", "--tokens", "alphabetical betamax gammaray deltaforce"],
                           env={"COLUMNS": "30"})
    assert " 0 alphabetical  1  ·  ·  ·\n" in narrow.stdout  # the rows keep the words, the columns positions
    long = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "600", "--tokens", " ".join(["w"] * 600)])
    assert "--tokens not shown: a density map has no room for words" in long.stdout


def test_a_piped_diff_map_is_as_wide_as_shows():
    result = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "600"])  # CliRunner: not a terminal
    rows = [line for line in result.stdout.splitlines() if line[:3].strip().isdigit()]
    assert rows and max(map(len, rows)) <= 80


def test_many_batch_rows_show_24_tables_and_say_what_is_left_out():
    lengths = ",".join(str(i % 3 + 1) for i in range(100))
    result = runner.invoke(app, ["diff", "causal", "padding", "--lengths", lengths])
    assert result.exit_code == 1
    assert result.stdout.count("\nbatch ") == 24 and "batch 24" not in result.stdout
    assert result.stdout.rstrip().endswith("24 batch rows shown; batch rows 24-99 not shown: --json counts every one")


def test_the_diff_table_carries_the_structure_marks():
    result = runner.invoke(app, ["diff", "document(0,0,0,1,1,1,1,1) & window(3)", "document(0,0,0,1,1,1,1,1)"])
    lines = result.stdout.splitlines()
    assert "              0  0  0  │  1  1  1  1  1" in lines and " 7       1    ·  ·  ·  │  B  B  1  1  1" in lines
    assert "              ─  ─  ─  ┼  ─  ─  ─  ─  ─" in lines
    assert lines[-1].endswith("· │ ─ doc boundaries (labels above the keys, beside the queries) · underlined: the diagonal")
    cached = runner.invoke(app, ["diff", "causal", "window(2)", "--offset", "3", "--len", "3"]).stdout
    assert " 5       A  A  A  ║  A  1  1" in cached.splitlines()


def test_a_region_compares_the_same_part_of_both():
    data = as_json("window(100)", "window(101)", "--len", 5000, "--rows", "1000:1010", "--keys", "850:1010")
    assert (data["only_a"], data["only_b"]) == (0, 10)  # key q-100 of each of the 10 rows
    assert diff("window(100)", "window(101)", "--len", 5000, "--rows", "10:20").exit_code == 0  # equal there


def test_html_writes_the_page_of_categories_and_keeps_the_exit_status(tmp_path):
    path = tmp_path / "d.html"
    result = diff("document(0,0,1,1)", "causal", "--html", path)
    assert result.exit_code == 1 and f"wrote {path}" in result.stderr
    page = path.read_text()
    assert '"page":"diff"' in page and "only in A" in page
    assert diff("causal", "causal", "--html", tmp_path).exit_code == 0 and (tmp_path / "diff.html").exists()


@pytest.mark.parametrize("args, says", [
    (["--html", "d.txt"], "--html 'd.txt': unknown extension '.txt'; use one of .html"),
    (["--html", "d.html", "--why", "2,1"], "--why 2,1 explains one cell and --html draws them all: give one of them"),
    (["--html", ""], "--html is empty: give a file name"),
])
def test_bad_html_is_one_line_and_writes_nothing(args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = diff("document(0,0,1,1)", "causal", *args)
    assert result.exit_code == 2 and result.stderr == f"maskcli: error: {says}\n"
    assert list(tmp_path.iterdir()) == []


def test_piped_a_diff_of_1000_keys_is_a_map_and_words_80_columns_wide():
    out = runner.invoke(app, ["diff", "window(4)", "window(5)", "--len", "1000"], env={"COLUMNS": None}).stdout
    assert max(map(len, out.splitlines())) <= 80
    text = " ".join(out.split())
    assert "rows: query position, ruler: key position; one character = 28 queries x 14 keys (exact, from key intervals)" in text
    assert "only A allows 0 cells · only B allows 996 · both allow 3,994" in text  # 996 = 1000 - 4 rows that see key q-4


def test_mask_files_are_compared_without_importing_torch(tmp_path):
    names = list(maskfiles.write(tmp_path).values())  # the same mask in five conventions
    commands = ([["diff", name, maskfiles.EXPRESSION] for name in names] + [["diff", names[0], name] for name in names[1:]]
                + [["diff", names[-1], "causal", "--json"]])
    ran = maskfiles.torch_after_each(commands, tmp_path)
    assert [code for _, code, _ in ran] == [0] * (len(commands) - 1) + [1]  # each is the expression; none is causal
    assert not any(loaded for *_, loaded in ran), [args for args, _, loaded in ran if loaded][:1]


def test_two_files_of_different_shapes_are_told_what_applies_to_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(torch.tril(torch.ones(6, 6, dtype=torch.bool)), "a.pt")
    torch.save(torch.tril(torch.ones(4, 4, dtype=torch.bool)), "b.pt")
    result = runner.invoke(app, ["diff", "a.pt", "b.pt"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        "maskcli: error: A and B do not cover the same cells: A has queries 0-5 · keys 0-5, B has queries 0-3 · keys 0-3: "
        "each file's shape is its own and no option changes it: compare the cells both cover with --rows 0:4 --keys 0:4, "
        "or compare masks of the same shape (two calls of the same size)\n"
    )
    assert "--len" not in result.stderr
    shared = runner.invoke(app, ["diff", "a.pt", "b.pt", "--rows", "0:4", "--keys", "0:4"])  # the advice works
    assert shared.exit_code == 0 and "equal" in shared.stdout
    one = runner.invoke(app, ["diff", "a.pt", "causal", "--len", "4"])
    assert one.exit_code == 2 and one.stderr.endswith(
        "the file's shape fixes its positions: leave out --len, --offset, --kv-start and --kv-len (the expression then "
        "takes the file's), or compare the cells both cover with --rows 0:4 --keys 0:4\n"
    )
    assert runner.invoke(app, ["diff", "a.pt", "causal"]).exit_code == 0  # left out, the expression follows the file


@pytest.mark.parametrize("tree", [
    ("and", [("kind", "document", {"labels": [[0, 0, 1, 1]]}), ("kind", "window", {"window": 2})]),
    ("or", [("kind", "causal", {}), ("kind", "blocks", {"labels": [[-1, 0, 0, -1]]})]),
    ("not", ("or", [("kind", "sink", {"sink": 1}), ("kind", "prefix", {"prefix": 2})])),
    ("and", [("kind", "local", {"chunk_size": 2}), ("or", [("kind", "window", {"window": 3}), ("kind", "sink", {"sink": 1})])]),
])
def test_the_names_diff_prints_paste_back_into_show(tree):
    """Issue 28 item 13: the `A:` line names its mask in words `maskcli show` takes, and they rebuild it: the cells of
    the printed name equal a double loop over the expression as written (definitions.py). (diff names a file by its
    path: only an expression has a name to paste.)"""
    printed = diff(ref.text(tree), "causal", "--len", 4)
    name = printed.stdout.splitlines()[0].removeprefix("A: ")
    shown = runner.invoke(app, ["show", name, "--len", "4", "--json"])
    assert shown.exit_code == 0, (name, shown.output)
    cells = np.asarray(json.loads(shown.stdout)["mask"], dtype=bool)[0, 0]
    assert np.array_equal(cells, np.array(ref.dense(tree, q0=0, lq=4, k0=0, lk=4))[0]), name


def test_sizes_without_a_placing_place_the_file_where_show_places_them(tmp_path):
    """--len 3 --kv-len 7 puts the queries at 0-2 (as `show`, and inspect's rebuild command, place them): a file of that
    shape is read there too, so the file `show` saved is equal to its expression; with no sizes a file's queries sit
    at the end of its keys, as before."""
    top_left = torch.ones(3, 7, dtype=torch.bool).tril()  # queries 0-2 over keys 0-6: the reference
    path = tmp_path / "m.npy"
    np.save(path, top_left.numpy())
    result = diff("causal", path, "--len", 3, "--kv-len", 7, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["equal"] is True
    result = diff("window(2)", path, "--len", 3, "--kv-len", 7, "--json")
    data = json.loads(result.output)
    expected = torch.ones(3, 7, dtype=torch.bool).tril() & ~torch.ones(3, 7, dtype=torch.bool).tril(-2)
    assert result.exit_code == 1 and data["only_b"] == int((top_left & ~expected).sum()) == 1, result.output
    bottom_right = diff("causal", path, "--json")  # no sizes: the file's queries at 4-6, where causal sees 5 to 7 keys
    assert bottom_right.exit_code == 1 and json.loads(bottom_right.output)["only_a"] == 12


def test_two_files_of_different_shapes_with_why_get_the_advice_for_files_too(tmp_path, monkeypatch):
    """hunt 10: with --why the same two files were told "give both the same --len, --offset, --kv-start and --kv-len",
    options that a file's shape overrules."""
    monkeypatch.chdir(tmp_path)
    torch.save(torch.tril(torch.ones(6, 6, dtype=torch.bool)), "a.pt")
    torch.save(torch.tril(torch.ones(4, 4, dtype=torch.bool)), "b.pt")
    result = runner.invoke(app, ["diff", "a.pt", "b.pt", "--why", "3,1"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        "maskcli: error: A and B do not cover the same cells: A has queries 0-5 · keys 0-5, B has queries 0-3 · keys 0-3: "
        "each file's shape is its own and no option changes it: compare the cells both cover with --rows 0:4 --keys 0:4, "
        "or compare masks of the same shape (two calls of the same size)\n"
    )
    shared = runner.invoke(app, ["diff", "a.pt", "b.pt", "--why", "3,1", "--rows", "0:4", "--keys", "0:4"])  # the advice works
    assert shared.exit_code == 0, shared.output


def test_at_60_columns_the_header_and_row_words_wrap_never_to_column_0():
    """The header's shape line wrapped to column 0 ('intervals)' alone, read as a line of its own); it stands two cells
    in now, and a row's words under their indent."""
    narrow = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "6"], env={"COLUMNS": "60"})
    assert narrow.exit_code == 1
    assert narrow.stdout.splitlines()[:6] == [
        "A: causal",
        "B: window(3)",
        "shape (B=1, H=1, Lq=6, Lk=6) · they differ (exact, from key",
        "  intervals)",
        "only A allows 6 cells · only B allows 0 · both allow 15",
        "first rows that differ:",
    ]
    piped = runner.invoke(app, ["diff", "causal", "window(3)", "--len", "6"], env={"COLUMNS": None})
    assert "shape (B=1, H=1, Lq=6, Lk=6) · they differ (exact, from key intervals)\n" in piped.stdout
