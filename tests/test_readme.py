"""README.md: every console example prints what the README says it prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maskcli.commands import app

README = Path(__file__).resolve().parent.parent / "README.md"
runner = CliRunner()


def examples():
    """(command, expected lines) for each ```console block of the README."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", README.read_text(), re.S):
        lines = block.splitlines()
        command = lines[0].removeprefix("$ ")
        rest = lines[1:]
        while command.endswith("\\"):
            command = command[:-1] + rest.pop(0).strip()
        found.append((command, rest))
    return found


def flat(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.parametrize("command, expected", examples(), ids=[c for c, _ in examples()])
def test_console_examples_print_what_the_readme_shows(command, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner.invoke(app, ["show", "causal", "--len", "4", "--as", "min", "--save", "hf.npy"])  # the file inspect reads
    args = shlex.split(command)
    assert args[0] == "maskcli"
    result = runner.invoke(app, args[1:], env={"COLUMNS": "200"})
    assert result.exit_code == (1 if args[1] == "diff" else 0), result.output  # diff says "they differ" with 1
    got = [flat(line) for line in result.stdout.splitlines() if line.strip()]
    for i, line in enumerate(line for line in expected if line.strip()):
        if line.endswith("..."):
            assert got[i].startswith(flat(line[:-3])), (i, got[i])
        else:
            assert got[i] == flat(line), (i, got[i])


def test_every_command_in_the_readme_tables_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()  # the figures' commands write there
    table_lines = "\n".join(line for line in README.read_text().splitlines() if line.startswith("| `maskcli"))
    commands = re.findall(r"`(maskcli (?:show|chunk) [^`]*)`", table_lines)
    assert len(commands) >= 7
    for command in commands:
        for one in command.split(" / "):
            args = shlex.split(one if one.startswith("maskcli") else "maskcli " + one)
            result = runner.invoke(app, args[1:], env={"COLUMNS": "120"})
            assert result.exit_code == 0, (one, result.output)
