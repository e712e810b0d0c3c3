"""The checks scored on a folder of reproductions of published mask bugs: each program run through `maskcli trace`
with no --expect, as written (buggy) and with `--fixed`, in a process of its own. A bug is caught where the buggy run
exits 1 with a wrong finding; a false alarm is a fixed run with a wrong finding or exit 1. Not a timing: run by hand
(a minute or two a dozen programs) and read the table and its last line.

    python benchmarks/corpus.py tests/data/bugs [--only NAME ...] [--json scores.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def traced(program: Path, fixed: bool, folder: Path) -> dict:
    """exit status, the program's own exit status and the wrong findings' codes of one run."""
    out = folder / f"{program.stem}{'-fixed' if fixed else ''}.json"
    command = [sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
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
    parser.add_argument("folder", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help="program names (stems) to run")
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    args = parser.parse_args(argv)
    programs = sorted(p for p in args.folder.glob("*.py") if not p.name.startswith("_"))
    if args.only:
        programs = [p for p in programs if p.stem in set(args.only)]
    caught = alarms = broken = 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for program in programs:
            buggy, fixed = traced(program, False, Path(tmp)), traced(program, True, Path(tmp))
            results[program.stem] = {"buggy": buggy, "fixed": fixed}
            if buggy["program"] != 0 or fixed["program"] != 0:
                broken += 1
                verdict = f"program failed: {(buggy['error'] or fixed['error'] or '')[-160:]}"
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
    print(f"{caught} / {ran} caught, {alarms} false alarms on fixes, {broken} programs that did not run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
