"""The one check every tensor file type's test makes of a bad file through the CLI: one line on stderr, exit 2."""

from __future__ import annotations

from typer.testing import CliRunner

from maskcli.commands import app


def refused(args: list, *said: str) -> str:
    """Run maskcli with `args`: exit status 2, one line on stderr holding every text in `said`, nothing on stdout, no
    traceback; the line."""
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an escaped exception
    (line,) = result.stderr.splitlines()
    assert line.startswith("maskcli: error: ") and "Traceback" not in result.output and result.stdout == ""
    for text in said:
        assert text in line, line
    return line
