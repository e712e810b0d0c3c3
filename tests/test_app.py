"""The app: help, version, completion, did-you-mean, and what every command shares (warnings, errors)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from maskcli import __version__
from maskcli.commands import app

runner = CliRunner()


def test_help_shows_no_value_placeholder_on_flags():
    for command in ([], ["show"], ["attend"], ["diff"], ["kinds"]):
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0
        assert "<bool>" not in result.stdout
    show = runner.invoke(app, ["show", "--help"], env={"COLUMNS": "120"}).stdout
    assert "<int" in show  # options that take a value keep theirs (<int> or <integer>, by typer's version)


def _commands():
    import typer.main

    return typer.main.get_command(app).commands


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_commands_help_reads_at_60_columns_in_under_110_lines_each_option_with_its_help(name):
    # typer's four-column option table left 20 columns to the help at 60: attend's --help ran to 153 lines
    shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "60"})
    lines = shown.stdout.splitlines()
    assert shown.exit_code == 0 and len(lines) < 110 and max(map(len, lines)) <= 60, (name, len(lines))
    from maskcli.commands.app import _is_folded

    visible = [param for param in _commands()[name].params
               if not param.hidden and not _is_folded(name, param) and param.opts[0].startswith("--")]
    for param in visible:  # each option's first flag begins a line of its panel, its help beside or under it
        assert any(line.startswith(f"│ {param.opts[0]}") for line in lines), (name, param.opts[0])
    assert "--len, -n <integer>  Number of queries" in shown.stdout or name not in ("show", "attend")


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_commands_help_fits_60_lines_at_120_columns_and_help_all_shows_the_rest(name):
    import re

    shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "120"})
    assert shown.exit_code == 0 and len(shown.stdout.splitlines()) <= 60, (name, len(shown.stdout.splitlines()))
    every = runner.invoke(app, [name, "--help-all"], env={"COLUMNS": "120"})
    assert every.exit_code == 0 and "Usage:" in every.stdout
    flags = {opt for param in _commands()[name].params if not param.hidden for opt in param.opts if opt.startswith("--")}
    in_help, in_all = set(re.findall(r"--[a-z][a-z0-9-]*", shown.stdout)), set(re.findall(r"--[a-z][a-z0-9-]*", every.stdout))
    assert flags <= in_all, (name, flags - in_all)
    assert flags <= in_help, (name, flags - in_help)  # a folded option is still named, on --help-all's line
    folded = re.search(r"--help-all\s+Also show ([^.]*)\.", " ".join(line.strip("│ ") for line in shown.stdout.splitlines()))
    if name == "attend":
        assert folded and "--kv-start" in folded.group(1) and "--dropout-seed" in folded.group(1)
        assert "│ --dropout-seed " in every.stdout and "│ --dropout-seed " not in shown.stdout  # its own row only in --help-all


def test_version_long_and_short():
    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0 and result.stdout == f"maskcli {__version__}\n"


def test_shell_completion_is_offered_and_completes_commands():
    assert "--install-completion" in runner.invoke(app, ["--help"], env={"COLUMNS": "120"}).stdout
    result = runner.invoke(app, [], env={"_MASKCLI_COMPLETE": "complete_bash", "COMP_WORDS": "maskcli sh", "COMP_CWORD": "1"},
                           prog_name="maskcli")
    assert "show" in result.stdout.split()


def test_completion_for_a_named_shell_installs_that_shell(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    result = runner.invoke(app, ["--install-completion", "fish"])
    assert result.exit_code == 0 and result.stdout.startswith("fish completion installed in ")
    script = tmp_path / ".config" / "fish" / "completions" / "maskcli.fish"
    assert "_MASKCLI_COMPLETE" in script.read_text() and not (tmp_path / ".bashrc").exists()
    assert runner.invoke(app, ["--show-completion", "zsh"]).stdout.startswith("#compdef maskcli")
    refused = runner.invoke(app, ["--install-completion", "tcsh"])
    assert refused.exit_code == 2 and refused.stderr == (
        "maskcli: error: --install-completion 'tcsh': not a shell maskcli completes; "
        "give one of bash, zsh, fish, powershell, pwsh, or none for the shell you are in\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".config"]


def test_a_mistyped_command_gets_a_suggestion_on_one_line():
    result = runner.invoke(app, ["shwo", "causal"])
    assert result.exit_code == 2
    assert result.stderr == "maskcli: error: No such command 'shwo'. Did you mean 'show'? (see 'maskcli --help')\n"


def test_a_warning_is_not_followed_by_an_error_about_the_same_input():
    result = runner.invoke(app, ["show", "causal", "--dtype", "float16", "--save", "out.txt"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "warning" not in result.stderr
    result = runner.invoke(app, ["show", "causal", "--len", "2", "--dtype", "float16"])
    assert result.exit_code == 0 and "maskcli: warning: --dtype float16 is ignored" in result.stderr


def test_a_warning_wraps_under_its_text_at_60_columns_and_is_one_line_piped():
    args = ["show", "tril(-1)", "--len", "3"]
    assert runner.invoke(app, args, env={"COLUMNS": "60"}).stderr == (
        "maskcli: warning: 1 query row sees no key (0): softmax over\n"
        "                  nothing is NaN with an -inf fill (maskcli\n"
        "                  attend shows what each fill makes of it)\n"
    )
    assert runner.invoke(app, args, env={"COLUMNS": None}).stderr == (
        "maskcli: warning: 1 query row sees no key (0): softmax over nothing is NaN with an -inf fill "
        "(maskcli attend shows what each fill makes of it)\n"
    )


NARROW = [
    ["show", "causal", "--len", "20"],
    ["show", "window", "--len", "1048576", "--window", "128"],
    ["show", "document(0,0,1,1,1,2)", "--tokens", "the cat sat on the mat"],
    ["chunk", "0,0,1,1,1,1,2,2,2,3,4,4"],
    ["blocks", "document(sizes=[300,500,224]) & window(128)", "--block", "64"],
    ["diff", "window(4)", "window(5)", "--len", "12"],
    ["attend", "causal", "--len", "6"],
    ["verify", "causal", "--len", "6", "--repeat", "1"],
    ["kinds"],
    ["inspect", "[[1,0,0],[1,1,0],[1,1,1]]"],
    ["show", "--help"],
]


def test_every_command_reads_at_60_columns():
    for args in NARROW:
        result = runner.invoke(app, args, env={"COLUMNS": "60", "MASKCLI_DEVICE": "cpu"})
        assert result.exit_code in (0, 1), (args, result.output)
        wide = [line for line in result.stdout.splitlines() if len(line) > 60]
        assert not wide, (args, wide)


def test_at_60_columns_a_20_key_mask_is_still_a_table_and_verify_keeps_its_numbers():
    import re

    shown = runner.invoke(app, ["show", "causal", "--len", "20"], env={"COLUMNS": "60"}).stdout.splitlines()
    assert shown[3].split() == ["q", "\\", "kv", *"0123456789" * 2]  # the ones digits under the tens line
    assert shown[4].split() == ["0", "1"] + ["0"] * 19 and shown[-1].split() == ["19"] + ["1"] * 20
    verify = runner.invoke(app, ["verify", "causal", "--len", "6", "--repeat", "1"], env={"COLUMNS": "60", "MASKCLI_DEVICE": "cpu"})
    assert "…" not in verify.stdout
    assert len(re.findall(r"\d\.\d\de-\d\d", verify.stdout)) >= 3  # every max |diff| whole
    assert " nn.MultiheadAttention " in verify.stdout  # the name whole, not broken across two lines
    for command in ("show", "attend", "verify", "blocks", "inspect", "convert", "diff", "kinds", "chunk", "trace", "model"):
        assert "…" not in runner.invoke(app, [command, "--help"], env={"COLUMNS": "60"}).stdout, command


def test_at_60_columns_wide_values_become_a_table_of_1_and_0_not_a_map():
    lines = runner.invoke(app, ["show", "causal", "--len", "12", "--as", "additive"], env={"COLUMNS": "60"}).stdout.splitlines()
    assert lines[2:4] == ["cells shown as 1 / 0 (1 = may attend): 0 / -inf do not fit", "  60 columns"]
    assert lines[5].split() == ["0", "1"] + ["0"] * 11 and lines[-1].split() == ["11"] + ["1"] * 12
    wide = runner.invoke(app, ["show", "causal", "--len", "4", "--as", "additive"], env={"COLUMNS": "120"}).stdout
    assert "-inf" in wide and "cells shown as" not in wide


def test_json_longer_than_one_write_comes_out_whole(monkeypatch):
    # one write(2) of 2 GiB or more is cut short by the kernel; echo writes in slices (here 7 characters)
    monkeypatch.setattr(sys.modules["maskcli.commands.app"], "ECHO_SLICE", 7)
    result = runner.invoke(app, ["show", "causal", "--len", "9", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("}\n") and json.loads(result.stdout)["mask"][0][0][8] == [1] * 9


def _help_examples():
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        lines = (command.epilog or "").split("\n")[1:]
        yield name, [line.split("  # ")[0] for line in lines if line.startswith("maskcli ")]


@pytest.mark.parametrize("name, lines", list(_help_examples()), ids=[name for name, _ in _help_examples()])
def test_every_help_example_runs_as_written(tmp_path, monkeypatch, name, lines):
    import shlex

    monkeypatch.chdir(tmp_path)  # an example may write a file a later one reads
    assert lines, f"{name} --help has no example"
    if name == "model":
        pytest.importorskip("transformers", reason="maskcli model's examples need the hf extra")
    import importlib.util

    import torch

    for line in lines:
        if "--device cuda" in line and not torch.cuda.is_available():
            continue  # shown for a GPU; run where there is one
        if " --model " in line and importlib.util.find_spec("transformers") is None:
            continue  # a family's config needs the hf extra (serve and shard say so in one line without it)
        result = runner.invoke(app, shlex.split(line)[1:], env={"MASKCLI_DEVICE": "cpu"})
        assert result.exit_code in ((0, 1) if name == "diff" else (0,)), (line, result.output)


def test_a_parse_error_on_a_terminal_gets_a_caret_under_the_text_and_one_line_elsewhere():
    import os
    import pty
    import subprocess
    import sys

    main, child = pty.openpty()
    done = subprocess.run([sys.executable, "-m", "maskcli", "show", "causal & & window(3)"], stdout=subprocess.DEVNULL, stderr=child,
                          timeout=60)
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    lines = seen.decode().replace("\r", "").splitlines()
    assert done.returncode == 2
    assert lines[0].startswith("maskcli: error: mask expression 'causal & & window(3)': expected a kind name")
    assert lines[1:] == ["  causal & & window(3)", "           ^"]  # under the second &, character 10
    piped = subprocess.run([sys.executable, "-m", "maskcli", "show", "causal & & window(3)"], capture_output=True, text=True, timeout=60)
    assert piped.stderr.count("\n") == 1 and ">>" not in piped.stderr


@pytest.mark.parametrize("words, expected", [
    ("maskcli show causal --as bl", ["block"]),
    ("maskcli show win", ["window"]),
    ("maskcli show lo", ["local", "lookback"]),
    ("maskcli attend causal --like hf", ["hf-eager"]),
    ("maskcli attend causal --fill m", ["min", "multiply"]),
    ("maskcli attend causal --device c", ["cpu", "cuda"]),
    ("maskcli show causal --pad l", ["left"]),
])
def test_option_values_and_kind_names_complete(words, expected):
    result = runner.invoke(app, [], env={"_MASKCLI_COMPLETE": "complete_bash", "COMP_WORDS": words,
                                         "COMP_CWORD": str(len(words.split()) - 1)}, prog_name="maskcli")
    assert sorted(result.stdout.split()) == expected, result.output


KIND_FLAGS = "--window, --prefix, --sink, --chunk-size, --documents, --chunks, --sizes, --block-ids, --diagonal, --means, --parents"


@pytest.mark.parametrize("name", ["show", "blocks", "diff", "attend", "verify", "export"])
def test_kind_parameter_flags_are_named_on_help_all_line_and_shown_in_their_panel_by_help_all(name):
    shown = runner.invoke(app, [name, "--help"], env={"COLUMNS": "120"}).stdout
    every = runner.invoke(app, [name, "--help-all"], env={"COLUMNS": "120"}).stdout
    line = " ".join(row.strip("│ ") for row in shown.splitlines())
    assert f"the kind parameters {KIND_FLAGS}." in line
    assert "Kind parameters (for a bare kind name)" in every and "Kind parameters" not in shown
    for flag in KIND_FLAGS.split(", "):
        assert f"│ {flag} " in every and f"│ {flag} " not in shown, (name, flag)
    assert "│ --window            <integer>  window: keys each query sees: itself and the W-1 before it" in every
    assert "band: keys each query sees on either side, itself included" in " ".join(row.strip("│ ") for row in every.splitlines())
    assert "Kind parameters" not in runner.invoke(app, ["chunk", "--help-all"], env={"COLUMNS": "120"}).stdout  # labels only


def _example_rows(text: str) -> list[str]:
    rows = text.splitlines()
    start = next(at for at, row in enumerate(rows) if row.strip() in ("Example:", "Examples:"))
    return [row[1:].rstrip() for row in rows[start + 1:] if row.strip()]  # typer pads the epilog by one column


@pytest.mark.parametrize("name", sorted(_commands()))
def test_a_wrapped_example_continues_visibly_at_60_columns(name):
    command = _commands()[name]
    rows = _example_rows(runner.invoke(app, [name, "--help"], env={"COLUMNS": "60"}).stdout)
    for at, row in enumerate(rows):
        assert len(row) <= 58, (name, row)
        if row.startswith("    "):
            assert rows[at - 1].endswith(" \\"), (name, rows[at - 1], row)  # the shell's continuation
        else:
            assert row.startswith(("maskcli ", "torchrun ", "# ")), (name, row)  # (maskcli, or it under a launcher)
        if row.endswith(" \\"):
            assert rows[at + 1].startswith("    "), (name, row)
    # joined back, the lines are the examples as written, each comment before its command
    joined = " ".join(rows).replace(" \\     ", " ").replace(" \\ ", " ")
    written = []
    for line in command.epilog.split("\n")[1:]:
        text, _, comment = line.partition("  # ")
        written += ([f"# {comment}", text] if comment and len(line) > 58 else [line])
    assert " ".join(joined.split()) == " ".join(" ".join(written).split()), name


def test_long_examples_break_at_an_option_and_put_their_comment_above():
    model = _example_rows(runner.invoke(app, ["model", "--help"], env={"COLUMNS": "60"}).stdout)
    assert model[1:3] == ["maskcli model gemma3_text --window 3 --lengths 5,3 \\", "    --new-tokens 2"]
    trace = _example_rows(runner.invoke(app, ["trace", "--help"], env={"COLUMNS": "60"}).stdout)
    assert trace[1:3] == ["# arguments after the program are the program's", "maskcli trace -m maskcli.trace.demo --len 8 --steps 1"]
    wide = _example_rows(runner.invoke(app, ["trace", "--help"], env={"COLUMNS": "120"}).stdout)
    assert "maskcli trace -m maskcli.trace.demo --len 8 --steps 1  # arguments after the program are the program's" in wide


def test_piped_tables_keep_no_trailing_spaces():
    for args in (["show", "causal", "--len", "3"], ["kinds"], ["diff", "causal", "window(2)", "--len", "4"], ["blocks", "causal", "--len", "256"]):
        result = runner.invoke(app, args, env={"COLUMNS": "120"})
        assert result.exit_code in (0, 1), (args, result.output)
        assert [line for line in result.stdout.splitlines() if line != line.rstrip()] == [], args
    assert runner.invoke(app, ["show", "causal", "--len", "3"]).stdout.splitlines()[2:] == [
        " q \\ kv  0  1  2", " 0       1  0  0", " 1       1  1  0", " 2       1  1  1",
    ]


def test_the_top_level_help_gives_one_example_a_line():
    """`maskcli --help` gave its examples on one line joined by '·', which a 60-column terminal broke inside the
    second ('maskcli show' / '"document(0,0,1,1) & window(2)"'): one a line now, as each command's help has them,
    and each runs."""
    shown = runner.invoke(app, ["--help"], env={"COLUMNS": "60"})
    assert shown.exit_code == 0, shown.output
    rows = [row.strip() for row in shown.stdout.splitlines()]
    start = rows.index("Examples:")
    assert rows[start + 1:start + 4] == ["maskcli show causal --len 6", 'maskcli show "document(0,0,1,1) & window(2)"', "maskcli kinds"]
    import shlex

    for example in rows[start + 1:start + 4]:
        result = runner.invoke(app, shlex.split(example)[1:], env={"COLUMNS": "60"})
        assert result.exit_code == 0, (example, result.output)
