"""The app: help, version, completion, did-you-mean, and what every command shares (warnings, errors)."""

from __future__ import annotations

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
    assert "<int>" in show  # options that take a value keep theirs


def test_version_long_and_short():
    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0 and result.stdout == f"maskcli {__version__}\n"


def test_shell_completion_is_offered_and_completes_commands():
    assert "--install-completion" in runner.invoke(app, ["--help"], env={"COLUMNS": "120"}).stdout
    result = runner.invoke(app, [], env={"_MASKCLI_COMPLETE": "complete_bash", "COMP_WORDS": "maskcli sh", "COMP_CWORD": "1"},
                           prog_name="maskcli")
    assert "show" in result.stdout.split()


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
