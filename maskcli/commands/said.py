"""What a command says on stderr besides its view and its one error line: warnings, held until its input is all
checked, and the files it wrote, said once it has ended well (fail() drops both, and removes those files)."""

from __future__ import annotations

import sys

import typer

from maskcli.render import wrapped

_pending: list[str] = []


def warn(message: str, now: bool = False) -> None:
    """A warning on stderr: held until the command has checked all of its input (an error then says it
    alone), unless `now` (before long work the user may want to stop)."""
    _pending.append(message)
    if now:
        flush_warnings()


def flush_warnings() -> None:
    for message in _pending:
        typer.echo(wrapped(f"maskcli: warning: {message}", sys.stderr), err=True, nl=False)
    _pending.clear()


_written: list[str] = []


def done(message: str) -> None:
    """What was written, said on stderr (stdout stays the view, or the JSON) once the command has ended well: where it
    then fails (a full stdout, a second file that cannot be written), the one line says why and the files it made
    are removed (fail())."""
    _written.append(message)


def flush_written() -> None:
    flush_warnings()
    for message in _written:  # wrapped between words on a terminal, as warnings are (not where the terminal cuts)
        typer.echo(wrapped(message, sys.stderr), err=True, nl=False)
    _written.clear()


def unwrite() -> None:
    """The files this command made (none was there before), removed: it failed, so it leaves none of its output."""
    import contextlib
    import os

    from maskcli.files import CREATED

    _written.clear()
    for path in CREATED:
        with contextlib.suppress(OSError):
            os.unlink(path)
    CREATED.clear()
