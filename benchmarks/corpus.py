"""The checks scored on a folder of reproductions of published mask bugs: each program run through `maskcli trace`
with no --expect, as written (buggy) and with `--fixed`, in a process of its own. A bug is caught where the buggy run
exits 1 with a wrong finding; a false alarm is a fixed run with a wrong finding or exit 1. Not a timing: run by hand
(a minute or two a dozen programs) and read the table and its last line.

    python benchmarks/corpus.py tests/data/bugs [--only NAME ...] [--json scores.json]
    python benchmarks/corpus.py tests/data/blind/MANIFEST_blind-fz.md [--tree DIR]   (a blind batch, before tuning)
    python benchmarks/corpus.py --quiet tests/data/quiet_blind/MANIFEST_quiet-zr.md  (correct programs: no --fixed)
    python benchmarks/corpus.py --covered > covered.txt   (the citations tests/data holds, for a new batch's writers)

A manifest (tests/data/blind/README.md says how a batch is written) names its programs in its table's first column;
one caught since and moved to tests/data/bugs is found there. --tree runs another checkout's maskcli (a branch's
worktree) on the same programs.
"""

from __future__ import annotations

import argparse
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
    """(file, citation) of each row of a manifest's table."""
    return [(name, cite) for name, cite in ROW.findall(manifest.read_text()) if name != "file"]


def programs_of(path: Path) -> list[Path]:
    """The programs a folder holds, or those a manifest names (in its folder, or in tests/data/bugs once moved)."""
    if path.is_dir():
        return sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    bugs = ROOT / "tests" / "data" / "bugs"
    return [next((folder / name for folder in (path.parent, bugs) if (folder / name).exists()), path.parent / name)
            for name, _ in listed(path)]


def covered() -> str:
    """Every citation the manifests of tests/data name, and the first line of every program there."""
    seen = {f"{cite} [{name}]" for manifest in (ROOT / "tests" / "data").rglob("MANIFEST*.md")
            for name, cite in listed(manifest)}
    for program in (ROOT / "tests" / "data").rglob("*.py"):
        head = program.read_text(errors="replace").lstrip().splitlines()[:1]
        if head:
            seen.add(f"{head[0].strip(chr(35) + chr(34)).strip()[:200]} [{program.name}]")
    return "\n".join(sorted(seen))


def traced(program: Path, fixed: bool, folder: Path, tree: Path | None = None) -> dict:
    """exit status, the program's own exit status and the wrong findings' codes of one run."""
    out = folder / f"{program.stem}{'-fixed' if fixed else ''}.json"
    command = [sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])]
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        return {"status": None, "program": None, "wrong": [], "other": [], "error": "timed out after 300 s"}
    if not out.exists():
        return {"status": done.returncode, "program": None, "wrong": [], "other": [], "error": done.stderr.strip()[-300:]}
    data = json.loads(out.read_text())
    findings = [f for group in data.get("groups", []) for f in group.get("findings", [])]
    findings += data.get("findings", []) if isinstance(data.get("findings"), list) else []
    return {
        "status": done.returncode,
        "program": data.get("exit_status"),
        "wrong": sorted({f["code"] for f in findings if f.get("severity") == "wrong"}),
        "other": sorted({f"{f['code']}({f.get('severity')})" for f in findings if f.get("severity") != "wrong"}),
        "error": None if data.get("exit_status") == 0 else done.stderr.strip()[-300:],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="*", help="folders of programs, or MANIFEST_*.md files")
    parser.add_argument("--only", nargs="*", default=None, help="program names (stems) to run")
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    parser.add_argument("--tree", type=Path, default=None, help="the checkout whose maskcli runs (default: installed)")
    parser.add_argument("--quiet", action="store_true", help="correct programs: one run each, any wrong finding an alarm")
    parser.add_argument("--covered", action="store_true", help="print the citations tests/data holds, and stop")
    args = parser.parse_args(argv)
    if args.covered:
        print(covered())
        return 0
    programs = [p for path in args.folder for p in programs_of(path)]
    if args.only:
        programs = [p for p in programs if p.stem in set(args.only)]
    caught = alarms = broken = 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for program in programs:
            buggy = traced(program, False, Path(tmp), args.tree)
            fixed = buggy if args.quiet else traced(program, True, Path(tmp), args.tree)
            results[program.stem] = {"buggy": buggy, "fixed": fixed}
            if buggy["program"] != 0 or fixed["program"] != 0:
                broken += 1
                verdict = f"program failed: {(buggy['error'] or fixed['error'] or '')[-160:]}"
            elif args.quiet:
                alarms += bool(buggy["wrong"]) or buggy["status"] != 0
                verdict = ("FALSE ALARM " + ",".join(buggy["wrong"] or [f"exit {buggy['status']}"])
                           if buggy["wrong"] or buggy["status"] != 0 else "quiet " + ",".join(buggy["other"]))
            else:
                hit = buggy["status"] == 1 and bool(buggy["wrong"])
                alarm = fixed["status"] != 0 or bool(fixed["wrong"])
                caught += hit
                alarms += alarm
                verdict = ("caught " + ",".join(buggy["wrong"]) if hit else "MISSED " + ",".join(buggy["other"]))
                verdict += ("  FALSE ALARM on fix: " + ",".join(fixed["wrong"] or [f"exit {fixed['status']}"])) if alarm else ""
            print(f"{program.stem:48s} {verdict}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ran = len(programs) - broken
    if args.quiet:
        print(f"{ran} correct programs, {alarms} false alarms, {broken} programs that did not run")
        return 0
    print(f"{caught} / {ran} caught, {alarms} false alarms on fixes, {broken} programs that did not run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
