"""Each call's first finding against the facts the program's frames hold at it (a list under one key of its details)."""

from __future__ import annotations

from typing import Callable

from maskcli.checks.context import Run, cross


def first_findings(run: Run, key: str, usable: Callable, judge: Callable) -> list:
    """(call, finding) for each self-attention call that `usable` keeps, of the first fact in details[key] that
    `judge(call, fact)` finds against (a Finding, or None); each (mask, fact) is judged once, the same mask's other
    calls are not told again."""
    found, done = [], set()
    for call in run.calls:
        helds = call.details.get(key)
        if not helds or call.stored is None or cross(call) or not usable(call):
            continue
        for held in helds:
            mark = (call.mask, id(held["rows"]))
            finding = None if mark in done else judge(call, held)
            done.add(mark)
            if finding is not None:
                found.append((call, finding))
                break
    return found
