"""How far a command walks through maskcli's modules: each module entered, and each climb back up into a module the
flow is still inside.

    PYTHONPATH=. python benchmarks/flow.py show --mask m.pt
    PYTHONPATH=. python benchmarks/flow.py --calls show --mask m.pt   (and the function of each entry)

Runs the command in this process under sys.setprofile and follows the innermost maskcli frame (frames of other
packages, torch's and numpy's, are seen through). A maskcli function calling into another maskcli module enters it;
the calls one frame makes into one module one after the other are one entry (a loop asking kinds for candidates
enters kinds once), so a module entered again is the flow coming back to it: from another caller, or after
another module in between. An entry into a module that is still on the call stack (A -> B -> A: a callback, or a
lower module calling back up) is a climb back up. Calls made while importing are left out (an import is not the
flow), and so are calls into the command layer (Typer's wiring, option parsing).

It prints on stderr (the command's own output goes to stdout), per module entered: its entries, how many modules
enter it, and every call into it (a frame's consecutive calls counted one by one: two modules calling each other
back and forth show there), then each climb back up.
"""

from __future__ import annotations

import sys
from collections import Counter


def module_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "maskcli" or name.startswith("maskcli.") else None


def follow(argv: list[str]) -> tuple[list[tuple[str, str, str, bool]], Counter, int]:
    """(caller module, callee module, callee function, whether it climbs back up) of each entry, in order; every call
    into another module counted by the module called (consecutive ones too); and the command's exit status."""
    from typer.main import get_command

    from maskcli.commands import app

    command = get_command(app)
    entries: list[tuple[str, str, str, bool]] = []
    calls: Counter = Counter()
    # per Python frame, outermost first: the innermost maskcli frame's record [module, the module it entered last]
    stack: list[list | None] = []
    importing = [0]

    def profile(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            if code.co_name == "<module>":
                importing[0] += 1
            here = module_of(frame)
            outer = stack[-1] if stack else None
            if here is None:
                stack.append(outer)
                return
            counted = outer is not None and here != outer[0] and not importing[0] and not here.startswith("maskcli.commands")
            if counted:
                calls[here] += 1
            if counted and outer[1] != here:
                inside = {record[0] for record in stack if record is not None}
                entries.append((outer[0], here, code.co_name, here in inside))
            if outer is not None and here != outer[0] and not importing[0]:
                outer[1] = here
            stack.append([here, None])
        elif event == "return":
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
    return entries, calls, status


def main() -> None:
    args = sys.argv[1:]
    calls = args[:1] == ["--calls"]
    args = args[1:] if calls else args
    entries, calls_, status = follow(args)
    entered = Counter(callee for _, callee, _, _ in entries)
    callers: dict[str, set] = {}
    for caller, callee, _, _ in entries:
        callers.setdefault(callee, set()).add(caller)
    climbs = [entry for entry in entries if entry[3]]
    print(f"exit status {status}; {len(entered)} modules entered, {len(entries)} entries, {len(climbs)} climbs back up",
          file=sys.stderr)
    print("  entries  from  calls  module (entered from how many modules; every call into it)", file=sys.stderr)
    for module, count in entered.most_common():
        print(f"  {count:7d}  {len(callers[module]):4d}  {calls_[module]:5d}  {module}", file=sys.stderr)
    for caller, callee, function, _ in climbs:
        print(f"  climbs back up: {caller} -> {callee}.{function}", file=sys.stderr)
    if calls:
        for caller, callee, function, climb in entries:
            print(f"  {caller} -> {callee}.{function}{'  (climbs back up)' if climb else ''}", file=sys.stderr)


if __name__ == "__main__":
    main()
