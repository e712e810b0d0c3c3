"""The Typer app and the one place where bad input becomes a line on stderr and exit status 2.

Commands register themselves on `app` (maskcli.commands imports every command module).
torch and matplotlib are imported inside the commands that need them, so `maskcli --help`
loads neither.
"""

from __future__ import annotations

import errno
import re
import sys
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

try:  # newer typer carries its own copy of click, with its own exception classes
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover - older typer raises click's
    from click import exceptions as _click_exceptions

from maskcli import __version__
from maskcli.commands.guards import floor_columns, no_nul
from maskcli.commands.messages import smaller as _smaller, usage_message as _usage_message
from maskcli.commands.said import _pending, _written, done, flush_warnings, flush_written, unwrite, warn  # noqa: F401
from maskcli.errors import MaskError
from maskcli.text import wrap_example

UsageError = _click_exceptions.UsageError
NoArgsIsHelpError = getattr(_click_exceptions, "NoArgsIsHelpError", ())


class _Interrupted(Exception):
    """Ctrl-C inside a command, carried past typer (which would turn it into a silent exit 130)."""


class _PipeClosed(Exception):
    """The reader of stdout went away, carried past typer (which would exit 1)."""


class MaskcliGroup(TyperGroup):
    """Every bad input, ours or click's, ends as one line on stderr and exit status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None
        except BrokenPipeError:
            raise _PipeClosed() from None

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:  # typer's words say nothing of naming a shell, which maskcli takes
            if "--install-completion" in param.opts:
                param.help = "Install completion for your shell, or the one named after it: bash, zsh, fish, powershell or pwsh."
            elif "--show-completion" in param.opts:
                param.help = "Print the completion script for your shell (or the one named after it), to install it yourself."
        return params

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from maskcli.files import CREATED

        _pending.clear()
        _written.clear()
        CREATED.clear()
        floor_columns()
        from rich.console import Console

        Console.on_broken_pipe = _pipe_closed
        given = sys.argv[1:] if args is None else list(args)
        if sys.stdout is None and given[:1] != ["trace"]:  # started with stdout closed (>&-): every table and --json
            # would vanish; trace's stdout is the program's (python runs one with it closed) and its report stderr
            fail("stdout is closed, so nothing maskcli prints can be seen: send it to a file or /dev/null instead")

        def run():
            no_nul(given)
            code = _completion_for(given)
            if code is None:
                code = super(MaskcliGroup, self).main(args, prog_name, complete_var, standalone_mode=False, **extra)
                flush_warnings()
            return code

        code = handled(run, given)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


SIGNALS: dict = {}  # signal number -> its handler before main() set maskcli's (trace gives them back to the program)
OWN_PROCESS: list = []  # [True] once main() runs: the process is maskcli's, which ends as a traced program's would

SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _completion_for(args: list[str]) -> int | None:
    """--install-completion SHELL or --show-completion SHELL for a named shell (typer takes no value and would
    silently install for the shell it detects); None where neither is given with a value."""
    if len(args) != 2 or args[0] not in ("--install-completion", "--show-completion"):
        return None
    flag, shell = args
    if shell not in SHELLS:
        raise MaskError(f"{flag} {shell!r}: not a shell maskcli completes; give one of {', '.join(SHELLS)}, or none for the shell you are in")
    from typer._completion_shared import get_completion_script, install

    if flag == "--show-completion":
        typer.echo(get_completion_script(prog_name="maskcli", complete_var="_MASKCLI_COMPLETE", shell=shell))
        return 0
    shell, path = install(shell=shell, prog_name="maskcli", complete_var="_MASKCLI_COMPLETE")
    typer.echo(f"{shell} completion installed in {path}")
    typer.echo("Completion will take effect once you restart the terminal")
    return 0


def handled(run, args: list[str]) -> int:
    """run()'s exit status as maskcli gives a command's: every bad input, ours or click's, told as one line on stderr
    with status 2 (fail() raises SystemExit(2)), an interruption 130, a closed stdout 141."""
    try:
        code = run()
    except typer.Exit as stop:  # (a command's work run outside click: trace's report where the program calls os._exit)
        code = stop.exit_code
    except NoArgsIsHelpError as error:
        typer.echo(error.ctx.get_help())
        code = 0
    except UsageError as error:
        command = error.ctx.command_path if error.ctx else "maskcli"
        fail(f"{_usage_message(error, args).rstrip('.')} (see '{command} --help')")
    except MaskError as error:
        fail(str(error), error.pointer)
    except (_Interrupted, KeyboardInterrupt):
        typer.echo("maskcli: interrupted", err=True)
        code = 130
    except (_PipeClosed, BrokenPipeError):
        quiet_stdout()  # the reader went away (| head): stop quietly, as a killed pipe writer does
        code = 141
    except MemoryError:
        fail(f"ran out of memory: {_smaller(args)}")
    except OSError as error:
        if error.filename is None and error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # (a write to stdout:
            # /dev/full, a full disk behind `> out.txt`; the files maskcli writes name themselves)
            fail(f"{error.strerror or error} while writing the output: send it (stdout) to a disk with room, or to /dev/null")
        fail(f"{error.strerror or error}{': ' + repr(error.filename) if error.filename else ''}")
    except RecursionError:
        fail("the input is nested too deeply to read: give a flat list or a file")
    except Exception as error:
        if "can't allocate memory" in str(error) or type(error).__name__ == "OutOfMemoryError":
            fail(f"ran out of memory: {_smaller(args)}")
        fail(f"unexpected {type(error).__name__}: {' '.join(str(error).split())[:300]} (a maskcli bug: please report the command)")
    flush_written()  # (not after fail(): the files are removed, and the one line says why)
    return code


def outcome(run) -> int:
    """handled(run), its SystemExit read as the status it carries: for a command's last work done outside click
    (trace's report where the program ends by os._exit, or in the process that reports for it)."""
    try:
        code = handled(run, sys.argv[1:])
    except SystemExit as stop:
        code = stop.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def make_console(**options):
    """A rich Console for a command's view, on stdout (stderr with stderr=True) with whole writes (WholeWrites)."""
    from rich.console import Console

    options.setdefault("file", WholeWrites(sys.stderr if options.pop("stderr", False) else sys.stdout))
    return Console(**options)


def _pipe_closed(console) -> None:
    """rich's handler for a reader that went away (| head) exits 1, which diff's caller reads as "they differ":
    every console, help's too, raises instead, and maskcli stops quietly with status 141 as other tools do."""
    console.quiet = True
    raise BrokenPipeError()


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that Python's last flush at exit finds no closed pipe."""
    _quiet(sys.stdout)


def _quiet(stream) -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass


LONGEST_ERROR = 1000  # characters in the error line: a reader of stderr gets a line, not a page


def fail(message: str, pointer: tuple[str, int] | None = None) -> None:
    """The error as one line on stderr, exit status 2; on a terminal, a caret under the text `pointer` names."""
    _pending.clear()  # a warning about input that is then refused would be a second line about the same thing
    unwrite()
    one_line = " ".join(message.splitlines())  # a quoted value (a repr, say) may hold line breaks
    room = LONGEST_ERROR - len("maskcli: error: ")
    if len(one_line) > room:  # a value or a list quoted whole: its start (what) and end (the fix) stay
        one_line = f"{one_line[:room - 305]} ... {one_line[-300:]}"
    try:
        typer.echo(f"maskcli: error: {one_line}", err=True)
        if pointer is not None and sys.stderr.isatty():
            text, at = pointer
            typer.echo(f"  {text}\n  {' ' * at}^", err=True)
    except (OSError, ValueError):  # stderr full or closed (2>/dev/full): the status still says what happened
        _quiet(sys.stderr)
    sys.exit(2)


LARGE_WRITE = 1 << 30  # bytes past which a write is announced before it starts


def check_write(path, size: int, flag: str) -> None:
    """Refuse a write the disk has no room for, and say so before one of a gigabyte or more starts."""
    from maskcli.files import check_disk
    from maskcli.memory import format_bytes

    check_disk(path, size, flag)
    if size >= LARGE_WRITE:
        warn(f"{flag} writes {format_bytes(size)} to {str(path)!r}; this takes a while (Ctrl-C stops it and leaves no file)", now=True)


ECHO_SLICE = 1 << 24  # bytes per write
_TRAILING = re.compile(r"[ \t]+\n")  # spaces at the end of a line


def echo(text: str) -> None:
    """`text` and a newline on stdout, every byte of it or an error (see write_all)."""
    write_all(sys.stdout, text + "\n")


def write_all(out, text: str) -> None:
    """Write `text` to the text stream `out` whole, or raise: one write of 2 GiB or more is cut short by the
    kernel, and under `python -u` (PYTHONUNBUFFERED) a short write to a pipe whose reader left (| head -c 10)
    was dropped without a word and exit 0, where the next write would have said the pipe is closed (141)."""
    binary = getattr(out, "buffer", None)
    if binary is None:  # a stream with no bytes beneath it (a StringIO): it takes all it is given
        out.write(text)
        out.flush()
        return
    out.flush()  # what was printed before goes first
    data = memoryview(text.encode(out.encoding or "utf-8", out.errors or "strict"))
    while data:
        written = binary.write(data[:ECHO_SLICE])
        if written is None:  # a non-blocking stdout that is full: wait for room
            import select

            select.select([], [binary], [])
            continue
        data = data[written:]  # a short write is followed by another, which says why it was short
    binary.flush()


class WholeWrites:
    """A text stream whose writes are whole or raise (write_all), for rich's console; the rest is the stream's.

    Piped, each line loses the spaces rich pads it with to the table's or the terminal's width (a file or a
    `diff` of two outputs would carry them); on a terminal they are left, where they may hold a background."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        isatty = getattr(self._stream, "isatty", None)
        if not (isatty and isatty()):
            text = _TRAILING.sub("\n", text)
        write_all(self._stream, text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


# Options --help leaves out, so that it fits a screen (--help-all and docs/reference.md show them): python parameter
# names (commands/options.py) for every command, COMMAND.NAME for one, and every option in FOLDED_PANELS.
# --help still names each on --help-all's line.
FOLDED = frozenset({
    "m_kv_start", "m_align", "m_pad_id", "m_key", "m_from", "m_causal", "m_mask_mod_args",
    "i_batch", "i_head_dim", "i_d_out", "i_qkv_bias", "i_scale",
    "trace.check_", "trace.rank_timeout", "shard.rank_mask",
    "attend.dropout", "attend.dropout_seed", "attend.precision", "attend.batch_index", "attend.head",
})
KIND_PANEL = "Kind parameters (for a bare kind name)"  # commands/options.py declares the kind parameter flags in it
FOLDED_PANELS = frozenset({KIND_PANEL})  # a bare kind's parameters: an expression carries them, window(3)


class MaskcliCommand(typer.core.TyperCommand):
    """A command whose --help leaves out the less used options (FOLDED), which --help-all shows with the rest."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        folded = [p for p in params if _is_folded(self.name, p)]
        options = _flags([p for p in folded if p.rich_help_panel not in FOLDED_PANELS])
        kinds = _flags([p for p in folded if p.rich_help_panel in FOLDED_PANELS])
        shown = ", ".join(filter(None, [options, kinds and f"the kind parameters {kinds}"]))
        help_all = typer.core.TyperOption(  # every command takes it; listed where it shows more than --help
            param_decls=["--help-all"], is_flag=True, expose_value=False, is_eager=True, callback=_print_help_all,
            help=f"Also show {shown}.", hidden=not folded,
        )
        return [*params, help_all]

    def format_help(self, ctx, formatter):
        from maskcli.commands.helppanel import install

        install()  # on a narrow terminal, each option's help under its name
        shown = ctx.meta.get("maskcli.help_all", False)
        folded = [p for p in self.params if _is_folded(self.name, p)]
        for param in folded:
            param.hidden = not shown
        epilog = self.epilog
        if epilog:  # rich would fold a long example at any space, and its pieces would read as separate commands
            from typer.rich_utils import _get_rich_console

            width = _get_rich_console().width - 2  # the epilog's padding
            self.epilog = "\n".join(row for line in epilog.split("\n") for row in wrap_example(line, width))
        try:
            return super().format_help(ctx, formatter)
        finally:
            self.epilog = epilog
            for param in folded:
                param.hidden = False


def _is_folded(command: str | None, param) -> bool:
    return param.name in FOLDED or f"{command}.{param.name}" in FOLDED or getattr(param, "rich_help_panel", None) in FOLDED_PANELS


def _flags(params) -> str:
    """The long flag of each option (its first where it has none), comma-separated."""
    return ", ".join(p.opts[-1] if p.opts[-1].startswith("--") else p.opts[0] for p in params)


def _print_help_all(ctx, param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta["maskcli.help_all"] = True
    typer.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


class MaskcliTyper(typer.Typer):
    """Commands are MaskcliCommands (folded help) unless a command names its own class."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or MaskcliCommand, **kwargs)


app = MaskcliTyper(
    cls=MaskcliGroup,
    name="maskcli",
    help="See and check attention masks: build them from kinds and expressions, show them as tables, "
    "exact density maps or heatmaps, and run attention through them.",
    # one example a line, as each command's help has them: on one line, a narrow terminal broke one in two
    epilog="Examples:\nmaskcli show causal --len 6\nmaskcli show \"document(0,0,1,1) & window(2)\"\nmaskcli kinds",
    no_args_is_help=True,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"maskcli {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", "-V", callback=version_callback, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """See and check attention masks."""
