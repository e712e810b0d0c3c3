"""Scoring the checks on reproductions written blind (issue 35): each program a MANIFEST_*.md table lists is run as
`maskcli trace --json` with no --expect, buggy and `--fixed`, in a process of its own, by the maskcli of --tree
(default: this checkout). A buggy run is caught when it has a wrong finding; a fixed run with a wrong finding is a
false alarm; suspicious findings are listed apart. With --quiet every program is a correct one (no --fixed run):
any wrong finding is a false alarm. Not a timing: run by hand, and read the table.

    python benchmarks/blind.py score tests/data/blind/MANIFEST_blind-fz.md [--tree DIR] [--quiet]
    python benchmarks/blind.py covered > covered.txt   # the citations tests/data already holds (for writers)

A program caught and moved to tests/data/bugs is found there. The program's exit status is kept: a program that did not run to its end is `broken`, neither caught nor quiet.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\|\s*`?([\w.\-]+\.py)`?\s*\|\s*(.*?)\s*\|", re.M)  # a manifest row: | file | citation | ...


def listed(manifest: Path) -> list[tuple[str, str]]:
    """(file, citation) of each row of the manifest's table."""
    return [(name, cite) for name, cite in ROW.findall(manifest.read_text()) if name != "file"]


def trace(tree: Path, program: Path, fixed: bool, timeout: int) -> dict:
    """The --json report of `maskcli trace PROGRAM [--fixed]` run by TREE's maskcli, or {'broken': why}."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=program.parent)
        except subprocess.TimeoutExpired:
            return {"broken": f"over {timeout} s"}
        if not out.exists():
            return {"broken": (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
        data = json.loads(out.read_text())
        if data.get("exit_status") != 0:
            return {"broken": f"the program exited {data.get('exit_status')}"}
        return data


def codes(data: dict, severity: str) -> list[str]:
    """The codes of the report's findings of one severity, each once, in order."""
    found = [f["code"] for group in data.get("groups", ()) for f in group["findings"] if f["severity"] == severity]
    return list(dict.fromkeys(found))


def score(manifest: Path, tree: Path, quiet: bool, timeout: int) -> int:
    rows = listed(manifest)
    caught = alarms = broken = 0
    for name, cite in rows:
        program = next((folder / name for folder in (manifest.parent, ROOT / "tests" / "data" / "bugs")
                        if (folder / name).exists()), manifest.parent / name)  # (a caught program moves to bugs/)
        runs = [("run", trace(tree, program, False, timeout))]
        if not quiet:
            runs.append(("fixed", trace(tree, program, True, timeout)))
        parts = []
        for label, data in runs:
            if "broken" in data:
                broken += 1
                parts.append(f"{label}: BROKEN {data['broken']}")
                continue
            wrong, doubt = codes(data, "wrong"), codes(data, "suspicious")
            if label == "run" and not quiet:
                caught += bool(wrong)
            else:
                alarms += bool(wrong)
            parts.append(f"{label}: wrong {','.join(wrong) or '-'}; suspicious {','.join(doubt) or '-'}")
        print(f"{name} ({cite[:60]})\n    " + "\n    ".join(parts), flush=True)
    if quiet:
        print(f"{manifest.name}: {len(rows)} correct programs, {alarms} with a wrong finding, {broken} broken")
    else:
        print(f"{manifest.name}: {caught} / {len(rows)} caught (a wrong finding), {alarms} false alarms on fixes, "
              f"{broken} runs broken")
    return 0


def covered() -> int:
    """Every citation the manifests of tests/data name and the first line of every program there: what a writer of
    a new blind batch must not write again."""
    seen = set()
    for manifest in sorted((ROOT / "tests" / "data").rglob("MANIFEST*.md")):
        for name, cite in listed(manifest):
            seen.add(f"{cite} [{name}]")
    for program in sorted((ROOT / "tests" / "data").rglob("*.py")):
        head = program.read_text(errors="replace").lstrip().splitlines()[:1]
        if head:
            first = head[0].strip('#"').strip()[:200]
            seen.add(f"{first} [{program.name}]")
    print("\n".join(sorted(seen)))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["covered"]:
        return covered()
    if argv[:1] != ["score"] or len(argv) < 2:
        print(__doc__)
        return 2
    tree, quiet, timeout, manifests = ROOT, False, 900, []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--tree":
            tree = Path(next(rest)).resolve()
        elif arg == "--quiet":
            quiet = True
        elif arg == "--timeout":
            timeout = int(next(rest))
        else:
            manifests.append(Path(arg).resolve())
    for manifest in manifests:
        score(manifest, tree, quiet, timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
