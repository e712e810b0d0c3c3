"""--why: one cell of a mask explained by its tree; every verdict against the definitions' double loop (tests/definitions.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import definitions as ref
from maskcli.commands import app
from maskcli.mask import MaskOptions, build
from maskcli.terms import terms
from maskcli.why import explain, parse_cell
from strategies import cases, expected_cells, uses_ids

runner = CliRunner()


def run(args):
    return runner.invoke(app, [str(arg) for arg in args])


def ok(args):
    result = run(args)
    assert result.exit_code == 0, result.output
    return result.stdout


def refused(args, exit_code=2):
    result = run(args)
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    return result.output.strip()


def leaves(node):
    return [node] if node.op is None else [leaf for child in node.children for leaf in leaves(child)]


def reference_params(term_json: dict) -> dict:
    """A Term's JSON parameters as tests/definitions.py takes them (labels as rows)."""
    params = {}
    for name, value in term_json["params"].items():
        if name in ("labels", "documents") and value is not None:
            value = value if isinstance(value[0], list) else [value]
        if value is not None:
            params[name] = value
    return params


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_every_cell_and_every_kind_in_the_tree_agree_with_the_definitions(case):
    tree, options, frame, valid = case
    built = build(ref.text(tree), MaskOptions(**options))
    expected = expected_cells(tree, options, frame, valid, built.batch)
    q0, lq, k0, lk = frame
    left = [ref.left_padding(row) for row in valid] if uses_ids(options) else [0] * built.batch
    ctx = {"q0": q0, "valid": valid, "left_pad": left}
    by_text = {term.text(): term for term in terms(built.tree)}
    for b in range(built.batch):
        for q in range(q0, q0 + lq):
            for kv in range(k0, k0 + lk):
                why = explain(built, b, q, kv)
                assert why.keep == bool(expected[b, q - q0, kv - k0]), (b, q, kv)
                for leaf in leaves(why.tree):  # each kind's own verdict is its definition's
                    term = by_text[leaf.text].json()
                    want = ref.kind_keeps(term["kind"], reference_params(term), b, q, kv, ctx)
                    assert leaf.keep == bool(want), (leaf.text, leaf.reason, b, q, kv)
                    assert leaf.reason


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases(), st.data())
def test_show_why_json_matches_show_json_cells(case, data):
    tree, options, frame, valid = case
    flags = []
    for name, flag in (("length", "--len"), ("offset", "--offset"), ("kv_start", "--kv-start"), ("kv_len", "--kv-len"),
                       ("align", "--align"), ("lengths", "--lengths"), ("ids", "--ids")):
        if options.get(name) is not None:
            flags += [flag, options[name]]
    text = ref.text(tree)
    cells = json.loads(ok(["show", text, "--json", *flags]))["mask"]
    q0, lq, k0, lk = frame
    q = data.draw(st.integers(q0, q0 + lq - 1))
    kv = data.draw(st.integers(k0, k0 + lk - 1))
    answer = json.loads(ok(["show", text, "--why", f"{q},{kv}", "--json", *flags]))
    assert [why["keep"] for why in answer["why"]] == [bool(cells[b][0][q - q0][kv - k0]) for b in range(len(cells))]
    assert all((why["q"], why["kv"], why["q_idx"], why["kv_idx"]) == (q, kv, q - q0, kv - k0) for why in answer["why"])


def test_show_why_in_words():
    assert ok(["show", "document(sizes=[350,162]) & window(128)", "--why", "400,300"]) == (
        "query 400, key 300 of document(sizes=[350,162]) & window(128): masked\n"
        "  & -> masked: document(sizes=[350,162]) masks it\n"
        "  ├─ document(sizes=[350,162]): label 1 at q 400, label 0 at kv 300: another document -> masked\n"
        "  └─ window(128): 400 - 300 = 100 < 128 -> kept\n"
        "positions: queries 0-511 · keys 0-511\n"
    )


def test_why_lines_wrap_under_their_own_text_at_60_columns_and_stay_whole_when_piped():
    args = ["show", "document(sizes=[300,212]) & window(128)", "--why", "400,300"]
    narrow = runner.invoke(app, args, env={"COLUMNS": "60"})
    assert narrow.exit_code == 0 and narrow.stdout == (
        "query 400, key 300 of document(sizes=[300,212]) &\n"
        "  window(128): kept\n"
        "  & -> kept: all 2 parts keep it\n"
        "  ├─ document(sizes=[300,212]): label 1 at q 400 and kv 300,\n"
        "     kv <= q -> kept\n"  # under the kind, not at column 0 where the terminal would put it
        "  └─ window(128): 400 - 300 = 100 < 128 -> kept\n"
        "positions: queries 0-511 · keys 0-511\n"
    )
    piped = runner.invoke(app, args, env={"COLUMNS": None})
    assert "  ├─ document(sizes=[300,212]): label 1 at q 400 and kv 300, kv <= q -> kept\n" in piped.stdout
    diff = runner.invoke(app, ["diff", "document(sizes=[300,212]) & window(128)", "window(100)", "--why", "400,300"], env={"COLUMNS": "60"})
    assert "A: query 400, key 300 of document(sizes=[300,212]) &\n   window(128): kept\n" in diff.stdout
    assert all(len(line) <= 60 for line in narrow.stdout.splitlines() + diff.stdout.splitlines())


def test_or_not_and_positions_in_words():
    out = ok(["show", "causal & (window(3) | sink(1)) & ~tril(-5)", "--why", "9,0", "--offset", "4", "--len", "6"])
    assert out == (
        "query 9, key 0 (q_idx 5, kv_idx 0 in the tensor) of causal & (window(3) | sink(1)) & ~tril(-5): masked\n"
        "  & -> masked: ~tril(-5) masks it\n"
        "  ├─ causal: kv 0 <= q 9 -> kept\n"
        "  ├─ window(3) | sink(1) -> kept: sink(1) keeps it\n"
        "  │  ├─ window(3): 9 - 0 = 9 >= 3 -> masked\n"
        "  │  └─ sink(1): kv 0 < 1: one of the first 1 keys -> kept\n"
        "  └─ ~tril(-5) -> masked: tril(-5) keeps it, and ~ flips that\n"
        "     └─ tril(-5): kv - q = -9 <= -5: a 1-cell of torch.tril(ones, -5), read as keep -> kept\n"
        "positions: queries 4-9 · keys 0-9 · 4 tokens before the queries (--offset)\n"
    )


def test_padding_in_words_for_each_batch_row():
    out = ok(["show", "causal", "--lengths", "6,3", "--why", "5,4"])
    assert "query 5, key 4, batch row 0 of causal: kept" in out
    assert "  └─ padding: batch row 0 has length 6: kv 4 < 6 -> kept" in out
    assert "query 5, key 4, batch row 1 of causal: masked" in out
    assert "  └─ padding: batch row 1 has length 3: kv 4 >= 3, a pad key -> masked" in out
    assert out.endswith("positions: queries 0-5 · keys 0-5 · lengths 6,3\n")
    left = ok(["show", "causal", "--lengths", "6,3", "--pad", "left", "--why", "1,5,1"])
    assert "padding: batch row 1 has length 3, padded left (real keys 3-5): kv 1 < 3, a pad key -> masked" in left
    ids = ok(["show", "local(2)", "--ids", "0,0,5,5,5,5,5,5", "--why", "6,5"])
    assert "local(2): chunks of 2 from the first real token 2: q 6 in the chunk from 6, kv 5 in the chunk from 4 -> masked" in ids
    assert "padding: ids[0][5] = 5, not the pad id 0 -> kept" in ids


@pytest.mark.parametrize("expression, cell, line", [
    ("chunk(0,0,1,1,2)", "1,3", "chunk(0,0,1,1,2): label 0 at q 1, label 1 at kv 3: 1 > 0 -> masked"),
    ("segment(0,0,1,1)", "0,1", "segment(0,0,1,1): label 0 at q 0 and kv 1: one segment, seen both ways -> kept"),
    ("blocks(-1,0,0,-1)", "0,1", "blocks(-1,0,0,-1): id -1 at q 0: no block -> masked"),
    ("lookback(2)", "1,3", "lookback(2): 1 - 3 = -2 < 2 (no causal edge: a later key is kept) -> kept"),
    ("prefix(3)", "0,2", "prefix(3): kv 2 < 3: in the prefix, seen both ways -> kept"),
    ("triu(1)", "2,4", "triu(1): kv - q = 2 >= 1: a 1-cell of torch.triu(ones, 1), read as block (1 = masked) -> masked"),
    ("document(0,0,0,1,1,1,1,1) & local(2)", "4,3",
     "local(2): chunks of 2 from each document's start: q 4 in the chunk from 3, kv 3 in the chunk from 3 -> kept"),
])
def test_each_kind_says_why(expression, cell, line):
    assert line in [text.lstrip(" │├└─") for text in ok(["show", expression, "--why", cell]).splitlines()]


def test_a_tensor_says_what_the_cell_is_and_why_there_is_no_tree(tmp_path):
    path = tmp_path / "m.npy"
    np.save(path, np.tril(np.ones((4, 4), dtype=bool)))
    out = ok(["show", "--mask", path, "--why", "3,1"])
    assert out.startswith("query 3, key 1 of ")
    assert ": kept\n  the cell of " in out and "a tensor has no expression, so there is no tree of kinds" in out
    data = json.loads(ok(["show", "--mask", path, "--why", "1,3", "--json"]))
    assert data["why"][0]["keep"] is False and data["why"][0]["tree"] is None


def test_heads_of_a_tensor_and_a_users_mask_mod(tmp_path, monkeypatch):
    keep = np.ones((1, 2, 4, 4), dtype=bool)
    keep[0, 1] = np.tril(keep[0, 1])
    np.save(tmp_path / "h.npy", keep)
    out = ok(["show", "--mask", tmp_path / "h.npy", "--why", "1,3"])
    assert ": kept in head 0 (heads: 0 kept, 1 masked)\n" in out
    (tmp_path / "mods.py").write_text("def stripes(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx) % 2 == 0\n")
    monkeypatch.chdir(tmp_path)
    out = ok(["show", "causal & stripes", "--mask-mod", "mods.py:stripes", "--len", "6", "--offset", "2", "--why", "7,3"])
    assert "  └─ stripes: your mask_mod stripes(b=0, h=0, q_idx=5, kv_idx=3) returned True -> kept\n" in out
    cells = json.loads(ok(["show", "causal & stripes", "--mask-mod", "mods.py:stripes", "--len", "6", "--offset", "2", "--json"]))["mask"]
    assert cells[0][0][5][3] == 1 and cells[0][0][5][2] == 0


def test_a_region_keeps_the_whole_masks_positions():
    out = ok(["show", "tree(-1,0,0,1)", "--offset", "4", "--rows", "6:8", "--keys", "4:8", "--why", "7,5"])
    assert "tree(-1,0,0,1): q 7 is draft 3, its line (itself <- ancestors) 3 <- 1 <- 0; kv 5 is draft 1, on it -> kept" in out
    assert out.endswith("positions: queries 4-7 · keys 0-7 · 4 tokens before the queries (--offset) · viewed over queries 6-7 · keys 4-7\n")
    assert refused(["show", "window(3)", "--len", "100", "--rows", "10:20", "--why", "5,3"]) == (
        "maskcli: error: --why 5,3: 5 is outside the queries 10-19 of this mask (the region --rows/--keys view): "
        "give Q,KV (absolute positions, queries 10-19, keys 0-99)")


def test_chunk_takes_why():
    out = ok(["chunk", "0,0,1,1", "--why", "1,2"])
    assert "chunk(0,0,1,1): label 0 at q 1, label 1 at kv 2: 1 > 0 -> masked" in out


def test_diff_explains_the_cell_in_a_and_in_b():
    result = run(["diff", "document(0,0,1,1)", "causal", "--why", "2,1"])
    assert result.exit_code == 1, result.output
    assert result.stdout == (
        "the cell query 2, key 1 differs: A masks it, B keeps it\n"
        "A: query 2, key 1 of document(0,0,1,1): masked\n"
        "  document(0,0,1,1): label 1 at q 2, label 0 at kv 1: another document -> masked\n"
        "B: query 2, key 1 of causal: kept\n"
        "  causal: kv 1 <= q 2 -> kept\n"
        "positions: queries 0-3 · keys 0-3\n"
    )
    data = json.loads(run(["diff", "document(0,0,1,1)", "causal", "--why", "3,2", "--json"]).stdout)
    assert data["same"] is True and data["A"]["why"][0]["keep"] is True and data["B"]["why"][0]["keep"] is True


@pytest.mark.parametrize("args, message", [
    (["show", "causal", "--why", "8,0"], "maskcli: error: --why 8,0: 8 is outside the queries 0-7 of this mask: give Q,KV (absolute positions, queries 0-7, keys 0-7)"),
    (["show", "causal", "--offset", "4", "--len", "2", "--why", "5,6"], "maskcli: error: --why 5,6: 6 is outside the keys 0-5 of this mask: give Q,KV (absolute positions, queries 4-5, keys 0-5)"),
    (["show", "causal", "--why", "3;4"], "maskcli: error: --why '3;4' is not a cell: give Q,KV (absolute positions, queries 0-7, keys 0-7), like 7,0"),
    (["show", "causal", "--lengths", "3,2", "--why", "2,1,1"], "maskcli: error: --why 2,1,1: batch row 2 is outside the mask's batch rows 0-1: give Q,KV (absolute positions, queries 0-2, keys 0-2) or B,Q,KV (batch rows 0-1)"),
    (["show", "causal", "--why", "1,1", "--summary"], "maskcli: error: --why 1,1 explains one cell and --summary counts them all: give one of them"),
])
def test_bad_cells_are_one_line_naming_the_valid_range(args, message):
    assert refused(args) == message


def test_every_built_in_kind_says_why_in_its_own_words():
    from maskcli.kinds import all_kinds

    assert [kind.name for kind in all_kinds() if kind.why is None] == []


def test_a_million_tokens_is_one_cell_of_work():
    """No intervals or cells of the whole mask are made: each kind answers from its definition at the cell."""
    mask = build("document(sizes=[600000,448576]) & window(4096) & local(8192)", MaskOptions(lengths="1048576,1000000"))
    answers = [explain(mask, b, q, kv) for b, q, kv in parse_cell("1040000,1039000", mask)]
    assert [why.keep for why in answers] == [True, False]
    assert "_intervals" not in mask.__dict__  # the cached intervals were never computed


@pytest.mark.parametrize("cell", ["9" * 5000 + ",0", "0," + "9" * 5000, "0," + "9" * 5000 + ",0", "9" * 20 + ",0"])
def test_a_cell_of_thousands_of_digits_is_one_short_line(tmp_path, cell):
    """hunt 9a: a tensor's --why 99...9,0 (5,000 digits) was "unexpected ValueError: Exceeds the limit (4300 digits)"."""
    path = tmp_path / "m.npy"
    np.save(path, np.tril(np.ones((4, 4), bool)))
    result = CliRunner().invoke(app, ["show", "--mask", str(path), "--why", cell])
    assert result.exit_code == 2, result.output
    digits = len(cell.split(",")[1 if cell.startswith("0,") else 0])
    assert f"digits is outside this mask: give Q,KV (absolute positions, queries 0-3, keys 0-3)" in result.stderr
    assert f"a number of {digits:,} digits" in result.stderr and len(result.stderr) < 300 and len(result.stderr.splitlines()) == 1
