"""Regenerate every command output, figure and the command reference in the docs from the pages themselves.

    python docs/generate.py            # rewrite outputs, figures and reference.md in place
    python docs/generate.py --check    # exit 1 and name what is out of date, write nothing

A page documents a command with a ```console block whose first line is `$ maskcli ...`; the rest
of the block is what the command prints (stdout, at 100 columns). A figure is an HTML comment
`<!-- figure: maskcli ... --png docs/img/NAME.png -->` before its image. reference.md holds each
command's --help between `<!-- help: CMD -->` markers. tests/test_docs.py runs --check.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COLUMNS = "100"
CONSOLE = re.compile(r"```console\n(\$ maskcli [^\n]*(?:\\\n[^\n]*)*)\n(.*?)```", re.S)
FIGURE = re.compile(r"<!-- figure: (maskcli [^>]*?) -->")
HELP = re.compile(r"<!-- help: (\w+) -->\n```text\n(.*?)```", re.S)
COMMANDS = ("show", "chunk", "blocks", "diff", "attend", "verify", "inspect", "convert", "kinds", "trace", "model")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _args(command: str) -> list[str]:
    args = shlex.split(command.replace("\\\n", " "))
    if args[0] != "maskcli":
        raise ValueError(f"not a maskcli command: {command!r}")
    return args[1:]


def run(command: str, cwd: Path | None = None) -> tuple[int, str]:
    """The command's exit status and stdout, run in-process as a user's terminal at 100 columns would show it."""
    from typer.testing import CliRunner

    from maskcli.commands import app

    before = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        result = CliRunner().invoke(app, _args(command), env={"COLUMNS": COLUMNS, "MASKCLI_DEVICE": "cpu", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"},
                                    prog_name="maskcli")
    finally:
        os.chdir(before)
    return result.exit_code, "\n".join(line.rstrip() for line in result.stdout.splitlines())


def console_blocks(text: str) -> list[tuple[str, str]]:
    """(command, documented output) for each console block of a page."""
    return [(match.group(1).removeprefix("$ "), match.group(2)) for match in CONSOLE.finditer(text)]


def figures(text: str) -> list[str]:
    return [match.group(1) for match in FIGURE.finditer(text)]


def refreshed_page(text: str) -> str:
    """The page with every console block's output as the command prints it now."""

    def replace(match: re.Match) -> str:
        command = match.group(1).removeprefix("$ ")
        code, output = run(command)
        if code not in (0, 1):
            raise SystemExit(f"{command!r} exited {code}:\n{output}")
        return f"```console\n{match.group(1)}\n{output}\n```"

    return CONSOLE.sub(replace, text)


def help_text(command: str) -> str:
    code, output = run(f"maskcli {command} --help")
    assert code == 0, output
    return output


def refreshed_reference(text: str) -> str:
    return HELP.sub(lambda m: f"<!-- help: {m.group(1)} -->\n```text\n{help_text(m.group(1))}\n```", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say what is out of date; write nothing")
    check = parser.parse_args().check
    stale = []
    for page in pages():
        text = page.read_text()
        new = refreshed_reference(refreshed_page(text))
        if new != text:
            stale.append(page.name)
            if not check:
                page.write_text(new)
        if not check:
            for command in figures(text):
                code, output = run(command)
                if code not in (0, 1):
                    raise SystemExit(f"{command!r} exited {code}:\n{output}")
    if check and stale:
        print("out of date: " + ", ".join(stale) + " (run python docs/generate.py)")
        sys.exit(1)


if __name__ == "__main__":
    main()
