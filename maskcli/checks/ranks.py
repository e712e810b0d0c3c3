"""Rules that compare the ranks of one traced job: data-parallel replicas of a layer attend with one window and pad
one side.

Each is given the job's calls (`ranks`): every rank's calls with .rank, .where, .step, .api and .name (the name
trace's report gave its mask, like `causal & window(4) (--lengths 5,4 --pad left)`), and whether the ranks said they
are replicas (a DistributedDataParallel built on them). A finding names its rank and the first step it differs at.
Padding lengths are a rank's own data and are not compared;
nor is causal against full, which context-parallel ranks' blocks differ in by design.
"""

from __future__ import annotations

import re
from collections import Counter

from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

WINDOW = re.compile(r"\bwindow\((\d+)\)")
SIDE = re.compile(r"--pad (left|right)\b")


def _side(name: str) -> str | None:
    """The side a name pads: left where it says so, right where it pads (--lengths, --ids) and says no side."""
    found = SIDE.search(name)
    if found:
        return found[1]
    return "right" if re.search(r"--(lengths|ids) ", name) else None


def replicas(calls: list, replicated: bool = False) -> list[tuple[object, Finding]]:
    """(call, Finding) for each rank whose calls at a layer and step attend another window, or pad the other side, than
    most ranks' calls there: one finding a rank and difference, naming its layers and steps, on its first such call.
    `replicated`: the ranks built DistributedDataParallel (so they run one model)."""
    sites: dict[tuple, dict[int, object]] = {}
    for call in calls:
        sites.setdefault((call.where, call.step, call.api), {}).setdefault(call.rank, call)
    differing: dict[tuple, list] = {}  # (code, rank, its value, the usual value) -> calls
    agreeing: dict[tuple, set] = {}  # the same -> the ranks of the usual value
    for by_rank in sites.values():
        if len(by_rank) < 2:
            continue
        for code, read in (("rank-window", _window), ("rank-padding-side", _side)):
            values = {rank: read(call.name) for rank, call in by_rank.items()}
            values = {rank: value for rank, value in values.items() if value is not None}
            if len(set(values.values())) < 2:
                continue
            counts = Counter(values.values())
            usual = max(counts, key=lambda value: (counts[value], -min(r for r, v in values.items() if v == value)))
            for rank, value in values.items():
                if value != usual:
                    differing.setdefault((code, rank, value, usual), []).append(by_rank[rank])
                    agreeing.setdefault((code, rank, value, usual), set()).update(r for r, v in values.items() if v == usual)
    condition = "" if replicated else " if these ranks run one model (data parallel: maskcli saw no DistributedDataParallel)"
    found = []
    for (code, rank, value, usual), where in sorted(differing.items(), key=lambda item: item[0][:2]):
        agree = sorted(agreeing[code, rank, value, usual])
        layers = ", ".join(dict.fromkeys(call.where or "call" for call in where))
        steps = sorted({call.step for call in where})
        said = (lambda v: f"window({v})") if code == "rank-window" else (lambda v: f"{v} padding")
        found.append((where[0], Finding(
            code, f"rank {rank}'s {layers} (step{'s' if len(steps) > 1 else ''} {spans(steps)}): {said(value)}, where "
                  f"rank{'s' if len(agree) > 1 else ''} {spans(agree)} {'have' if len(agree) > 1 else 'has'} {said(usual)}: "
                  f"the replicas of one layer differ{condition}",
            severity="wrong" if code == "rank-window" and replicated else None, expected=said(usual),
            source=f"rank {agree[0]}'s same calls", rank=rank, step=steps[0])))
    return found


def _window(name: str) -> int | None:
    found = WINDOW.search(name)
    return int(found[1]) if found else None


RULES = (
    Rule("rank-window", "suspicious", "ranks", "a rank whose layer attends another window than the other ranks' same "
         "layer (wrong where they built DistributedDataParallel: replicas of one model)", replicas, given="ranks"),
    Rule("rank-padding-side", "suspicious", "ranks", "a rank that pads the other side (left, right) than the other "
         "ranks at the same layer", replicas, given="ranks"),
)
