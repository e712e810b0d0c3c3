"""Every rank's part of a traced job as one report: calls numbered across ranks, groups of the same mask on any
rank said once with the ranks they are on, the rules that compare ranks (maskcli.checks.ranks), and what differs.

A part is what one rank's `maskcli trace` found of its own program (its calls, its groups named and checked on
that rank, with every rule that reads a run: those compare a call site's steps, which are a rank's own), as
`part()` writes it. Rank 0 merges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from maskcli.text import Finding, spans
from maskcli.trace.report import Group, where_text


def part(tracer, groups: list, status: int, program: str, failures: list[str], notes: list[str], unseen: list[str],
         job, watched) -> dict:
    """One rank's calls, masks, named groups with findings, --expect lines and exit status, in plain types."""
    import os
    import socket

    from maskcli.checks.registry import as_json

    used = {call.mask for call in tracer.calls if call.mask is not None}
    return {"program": program, "exit_status": status, "pid": os.getpid(), "host": socket.gethostname(),
            "local_rank": job.local_rank, "launcher": job.launcher, "process_groups": watched.found, "replicated": watched.replicated,
            "exchanged": sorted(watched.exchanged),
            "calls": [call.json() for call in tracer.calls],
            "groups": [{**group.json(), "findings": [as_json(f) for f in group.findings]} for group in groups],
            "masks": {key: value for key, value in tracer.masks.items() if key in used},
            "expect": failures, "notes": notes, "not_imported": unseen}


@dataclass
class RankCall:
    """A call of one rank as its part says it: numbered across the job (`index`) and within its rank (`rank_index`)."""

    index: int
    rank: int
    rank_index: int
    where: str
    step: int
    api: str
    shape: tuple
    mask: str | None
    details: dict
    name: str = ""  # its group's name of its mask
    data: dict = field(default_factory=dict, repr=False)

    def json(self) -> dict:
        return {**self.data, "index": self.index, "rank": self.rank, "rank_index": self.rank_index}


@dataclass
class RankGroup(Group):
    """A group whose calls may come from several ranks; `ranks` the ranks it is on, of `world`."""

    ranks: tuple = ()
    world: int = 1

    @property
    def where(self) -> str:
        text = where_text([call.where for call in self.calls])
        return text if len(self.ranks) == self.world else f"{rank_words(self.ranks)}: {text}"

    def json(self) -> dict:
        return {**super().json(), "ranks": list(self.ranks)}


def rank_words(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {spans(ranks)}"


@dataclass
class Merged:
    calls: list  # of RankCall, rank 0's first
    groups: list  # of RankGroup
    masks: dict
    parts: dict  # rank -> part
    missing: dict  # rank -> why it has no part
    world: int
    extra: list = field(default_factory=list)  # more lines for the report (what the spawning process did itself)

    def lines(self) -> list[str]:
        """Each rank's calls and exit status, what the ranks differ in, and the ranks that sent no part."""
        out = ["; ".join(f"rank {r}: {_calls(len(p['calls']))}, exit status {p['exit_status']}" for r, p in sorted(self.parts.items()))]
        partial = [(number, g) for number, g in enumerate(self.groups) if len(g.ranks) < len(self.parts)]
        if len(self.parts) > 1 and partial:
            out.append("the ranks differ: " + "; ".join(f"#{number} only on {rank_words(g.ranks)}" for number, g in partial))
        elif len(self.parts) > 1:
            out.append(f"every rank's calls have the same masks ({rank_words(self.parts)})")
        out += [f"rank {r}: {why}" for r, why in sorted(self.missing.items())] + self.extra
        said: dict[str, list[int]] = {}  # a line several ranks say, said once with their ranks
        for r, p in sorted(self.parts.items()):
            for line in p["not_imported"] + p["notes"]:  # (--expect's lines are failures(), shown with the groups)
                said.setdefault(line, []).append(r)
        out += [f"{'every rank' if len(ranks) == len(self.parts) > 1 else rank_words(ranks)}: {line}" for line, ranks in said.items()]
        return out

    def failures(self) -> list[str]:
        return [f"rank {r}: {line}" for r, p in sorted(self.parts.items()) for line in p["expect"]]

    def json(self, program: str, status: int) -> dict:
        numbers = {call.index: number for number, group in enumerate(self.groups) for call in group.calls}
        return {"program": program, "exit_status": status,
                "ranks": self.ranks(), "missing": {str(r): why for r, why in self.missing.items()},
                "calls": [{**call.json(), "group": numbers[call.index]} for call in self.calls],
                "groups": [group.json() for group in self.groups], "expect": self.failures(),
                "notes": [line for r, p in sorted(self.parts.items()) for line in (f"rank {r}: {x}" for x in p["notes"])] + self.extra}

    def ranks(self) -> list[dict]:
        """Each rank that reported: its exit status, its calls' numbers, its host and process, its process groups."""
        out, first = [], 0
        for r, p in sorted(self.parts.items()):
            out.append({"rank": r, "exit_status": p["exit_status"], "calls": [first, first + len(p["calls"])], "host": p["host"],
                        "pid": p["pid"], "local_rank": p["local_rank"], "launcher": p["launcher"],
                        "process_groups": p["process_groups"]})
            first += len(p["calls"])
        return out


def _calls(n: int) -> str:
    return f"{n} attention call{'s' if n != 1 else ''}"


def merge(parts: dict[int, dict], missing: dict[int, str], world: int) -> Merged:
    """The job's report from each rank's part (rank -> part): calls renumbered, groups of one mask, API, shape, name
    and findings joined across ranks in the order of their first call, and the rules that compare ranks."""
    from maskcli.checks import registry

    calls, masks, found = [], {}, {}
    for rank in sorted(parts):
        data = parts[rank]
        masks.update(data["masks"])  # (a mask's key is its content's digest: equal keys, equal masks)
        first = len(calls)
        mine = [RankCall(first + i, rank, i, c["where"], c["step"], c["api"], tuple(c["shape"]), c["mask"], c.get("details", {}),
                         data=c) for i, c in enumerate(data["calls"])]
        calls += mine
        for group in data["groups"]:
            findings = tuple(_finding(f) for f in group["findings"])
            key = (group["mask"], group["api"], tuple(group["shape"]), group["name"], tuple((f.code, f.message) for f in findings))
            entry = found.setdefault(key, {"calls": [], "name": group["name"], "expression": group["expression"],
                                           "findings": list(findings), "ranks": [], "named": group.get("named", True)})
            entry["calls"] += [mine[i] for i in group["calls"]]
            entry["ranks"].append(rank)
            for i in group["calls"]:
                mine[i].name = group["name"]
    groups = [RankGroup(sorted(e["calls"], key=lambda c: c.index), e["name"], e["expression"], e["findings"], e["named"],
                        tuple(sorted(set(e["ranks"]))), world) for e in found.values()]
    groups.sort(key=lambda g: g.calls[0].index)
    replicated = any(p.get("replicated") for p in parts.values())
    shared = _exchanged(calls, parts)
    left = 0
    for group in groups:
        if all(call.where in shared for call in group.calls):
            kept = [f for f in group.findings if not _positional(f)]
            left, group.findings = left + len(group.findings) - len(kept), kept
    by_call = {call.index: group for group in groups for call in group.calls}
    for call, finding in registry.run("ranks", [call for call in calls if call.where not in shared], replicated):
        group = by_call[call.index]
        if all((f.code, f.message) != (finding.code, finding.message) for f in group.findings):
            group.findings.append(finding)
    merged = Merged(calls, groups, masks, parts, missing, world)
    if left:
        merged.extra.append(PARTIAL.format(left, "s" if left > 1 else ""))
    return merged


def _exchanged(calls: list, parts: dict) -> set[str]:
    """The call sites whose keys came from other ranks: a site of which some rank's call came next after the program
    passed tensors between ranks (all_gather, send / recv, all_to_all), as context parallelism passes keys."""
    after = {(rank, index) for rank, data in parts.items() for index in data.get("exchanged", [])}
    return {call.where for call in calls if (call.rank, call.rank_index) in after}


PARTIAL = ("{} wrong finding{} left out at call sites whose keys came from other ranks (the program passed tensors "
           "between ranks before them: context-parallel parts, whose columns are not positions 0..Lk-1 as the rules "
           "read them): maskcli shard --trace checks each part at its global positions")


def _positional(finding: Finding) -> bool:
    """A wrong finding, made by a rule that reads a call's columns as positions 0..Lk-1: not a claim about a
    context-parallel rank's part, whose keys are other ranks' (a ring's full block of earlier tokens is right)."""
    from maskcli.checks.registry import severity

    return severity(finding) == "wrong"


def _finding(data: dict) -> Finding:
    cell = data.get("cell")
    return Finding(data["code"], data["message"], data.get("severity"), data.get("expected"), data.get("source"),
                   tuple(cell) if cell is not None else None)
