"""How far a command walks through maskcli's modules: each module entered, and each climb back up to a caller's.

    PYTHONPATH=. python benchmarks/flow.py show --mask m.pt
    PYTHONPATH=. python benchmarks/flow.py --calls show --mask m.pt   (and the function of each entry)

Runs the command in this process under sys.setprofile and follows the innermost maskcli module (frames of other
packages, torch's and numpy's, are seen through). A call whose function lives in another maskcli module than its
caller's is an entry into that module; the return to the caller's module is a climb back up. Calls made while
importing a module are left out (an import is not the flow), and so are the command layer's own (Typer's wiring,
option parsing). What it counts: the modules entered, how many times each, and the climbs; a module entered many
times, or two modules that call each other back and forth, is the flow going the long way.
"""

from __future__ import annotations

import sys
from collections import Counter


def module_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "maskcli" or name.startswith("maskcli.") else None


def follow(argv: list[str]) -> tuple[list[tuple[str, str, str]], int]:
    """(caller module, callee module, callee function) of each entry, in order, and the command's exit status."""
    from typer.main import get_command

    from maskcli.commands import app

    command = get_command(app)
    entries: list[tuple[str, str, str]] = []
    stack: list[str | None] = []  # the innermost maskcli module at each Python frame, outermost first
    importing = [0]

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        if event == "call":
            code = frame.f_code
            if code.co_name == "<module>":
                importing[0] += 1
            here = module_of(frame)
            outer = stack[-1] if stack else None
            inner = here or outer
            if here and outer and here != outer and not importing[0] and not here.startswith("maskcli.commands"):
                entries.append((outer, here, code.co_name))
            stack.append(inner)
        else:
            if stack:
                stack.pop()
            if frame.f_code.co_name == "<module>":
                importing[0] -= 1

    sys.setprofile(profile)
    try:
        command.main(argv, prog_name="maskcli", standalone_mode=False)
        status = 0
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else 1
    finally:
        sys.setprofile(None)
    return entries, status


def main() -> None:
    args = sys.argv[1:]
    calls = args[:1] == ["--calls"]
    args = args[1:] if calls else args
    entries, status = follow(args)
    entered = Counter(callee for _, callee, _ in entries)
    pairs = Counter(frozenset((caller, callee)) for caller, callee, _ in entries)
    print(f"exit status {status}; {len(entered)} modules entered, {len(entries)} entries and as many climbs back up",
          file=sys.stderr)
    for module, count in entered.most_common():
        print(f"  {count:4d}  {module}", file=sys.stderr)
    both = [(sorted(pair), n) for pair, n in pairs.items() if len(pair) == 2 and n > 1
            and all(any(c == a and e == b for c, e, _ in entries) for a, b in (sorted(pair), sorted(pair)[::-1]))]
    for (a, b), n in both:
        print(f"  back and forth: {a} <-> {b} ({n} entries)", file=sys.stderr)
    if calls:
        for caller, callee, function in entries:
            print(f"  {caller} -> {callee}.{function}", file=sys.stderr)


if __name__ == "__main__":
    main()
