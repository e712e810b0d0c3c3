"""Running a reproduction of a published mask bug (tests/data/bugs/NAME.py, its fix under --fixed) through
`maskcli trace` with no --expect: the exit status and every finding (code, severity) from --json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maskcli.commands import app

BUGS = Path(__file__).parent / "data" / "bugs"
ROWS = Path(__file__).parent / "data" / "rows"  # the same bugs written as other projects write them (checks/real.py)
runner = CliRunner()


def imports_transformers(program: Path) -> bool:
    """Whether the program imports transformers (its tests skip where the hf extra is not installed)."""
    return re.search(r"^\s*(?:from|import) transformers\b", program.read_text(), re.M) is not None


PATCHES = re.compile(r"^[A-Za-z_][\w.]*\.[A-Z]\w*\.forward *=", re.MULTILINE)  # a library class's forward replaced


def traced(tmp_path, name: str, fixed: bool, folder: Path = BUGS, args: tuple = ()) -> tuple[int, list[dict], str]:
    """(exit status, the findings of every group, the report) of `maskcli trace FOLDER/NAME.py [ARGS] [--fixed]`."""
    if imports_transformers(folder / f"{name}.py"):
        pytest.importorskip("transformers")  # (a program built from transformers' classes: the hf extra)
    out = tmp_path / f"{name}{'-'.join(('', *args))}{'-fixed' if fixed else ''}.json"
    command = ["trace", "--json", str(out), str(folder / f"{name}.py"), *args, *(["--fixed"] if fixed else [])]
    text = (folder / f"{name}.py").read_text()
    if "flex_attention(" in text or PATCHES.search(text):  # (dynamo's compiled code and its limits are the process's,
        status, output = _apart(command)  # trace/run.py forgets only its `__main__`; and a library's classes a program
        # patches, as unsloth's `modeling_gemma2.Gemma2Model.forward = ...`, stay patched: each is traced apart)
    else:
        result = runner.invoke(app, command)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        status, output = result.exit_code, result.output
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0, output  # the program itself ran to its end
    return status, [f for group in data["groups"] for f in group["findings"]], output


def _apart(command: list[str]) -> tuple[int, str]:
    """(exit status, output) of `python -m maskcli COMMAND` in a process of its own, this checkout's maskcli first."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "maskcli", *command], capture_output=True, text=True, timeout=600,
                          env=env)
    return done.returncode, done.stdout + done.stderr


def check_bug(tmp_path, name: str, code: str, folder: Path = BUGS, args: tuple = ()) -> list[dict]:
    """The buggy program is flagged with `code`, wrong, and exits 1; its fix has no wrong finding and exits 0. The
    buggy program's findings of `code`."""
    status, found, report = traced(tmp_path, name, False, folder, args)
    assert status == 1, report
    flagged = [f for f in found if f["code"] == code and f["severity"] == "wrong"]
    assert flagged, report
    status, found, report = traced(tmp_path, name, True, folder, args)
    assert [f for f in found if f["severity"] == "wrong"] == [], report
    assert status == 0, report
    return flagged


def caught(tmp_path, name: str, codes: tuple[str, ...]) -> dict:
    """tests/data/rows/NAME.py is flagged wrong by one of `codes` and exits 1 (that finding, for its cell); its fix
    exits 0 with no wrong and no suspicious finding."""
    status, found, report = traced(tmp_path, name, False, ROWS)
    assert status == 1, report
    hits = [f for f in found if f["code"] in codes and f["severity"] == "wrong"]
    assert hits, report
    status, found, report = traced(tmp_path, name, True, ROWS)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
    return hits[0]


def first(shape: tuple[int, int, int], bad) -> tuple[int, int, int] | None:
    """The first (b, q, k) in row-major order where bad(b, q, k), by a plain double loop (the tests' reference)."""
    for b in range(shape[0]):
        for q in range(shape[1]):
            for k in range(shape[2]):
                if bad(b, q, k):
                    return (b, q, k)
    return None
