"""`maskcli trace` as one rank of a job of several (torchrun, mpirun): every rank writes its part, rank 0 reports on all.

Ranks other than 0 print nothing and exit with their program's status; rank 0 waits for their parts, prints one
report (each rank's calls and exit status, the groups only some ranks have named with them, the rules that compare
ranks) and writes --save / --json with every rank's calls. Its exit status is its program's, else 1 where a finding
is wrong, an --expect fails, or a rank sent no part.
"""

from __future__ import annotations

import typer

from maskcli.commands.app import done, make_console


def report_ranks(tracer, job, process_groups, program: str, status: int, expectations, json_path: str | None,
                 save: str | None, targets: dict, unseen: list[str], check_: bool, timeout: float) -> None:
    """Write this rank's part (rank > 0) or gather every part and report (rank 0); always ends the command."""
    from maskcli.trace.expect import check
    from maskcli.trace.merged import merge, part

    with job.signals():  # (a SIGTERM from the launcher ends the waiting, not the report)
        groups = tracer.groups()
        failures = check(tracer.calls, expectations) if expectations else []
        mine = part(tracer, groups, status, program, failures, tracer.notes(), unseen, job, process_groups)
        if job.rank != 0:
            job.write(mine)
            if not job.wait_taken(timeout, status):  # (True: this rank reports in rank 0's place, which was killed
                raise typer.Exit(status)  # or still runs its program where this rank's failed)
        others, missing = job.gather(timeout, status)
        if job.rank == 0 and not job.claim():  # (a rank whose program failed reported in its place)
            job.clean()
            raise typer.Exit(status)
        try:
            _show(merge({job.rank: mine, **others}, missing, job.world), f"{program} ({job.world} ranks, {job.launcher})",
                  program, status, expectations, json_path, save, targets, check_)
        finally:  # (its report made: the other ranks may exit now)
            job.clean()


def report_spawned(tracer, spawns, program: str, status: int, expectations, json_path: str | None, save: str | None,
                   targets: dict, check_: bool, timeout: float) -> None:
    """The report on every process the program spawned (torch.multiprocessing.spawn), from their parts; always ends
    the command."""
    from maskcli.trace.merged import merge
    from maskcli.trace.spawned import LAUNCHER, gather

    parts, missing, reporter = gather(spawns, timeout)
    merged = merge(parts, missing, spawns.world)
    if tracer.calls:  # (the program's own process is no rank: its calls are said, not merged)
        merged.extra.append(f"the program's own process made {len(tracer.calls)} attention call{'s' if len(tracer.calls) != 1 else ''} "
                            "besides its spawned ranks': trace it without spawn to see them")
    merged.extra += tracer.notes()  # threads and processes it started otherwise, compiled code
    try:
        _show(merged, f"{program} ({spawns.world} processes, {LAUNCHER})", program, status, expectations, json_path, save, targets, check_)
    finally:
        reporter.clean()


def _show(merged, title: str, program: str, status: int, expectations, json_path: str | None, save: str | None, targets: dict,
          check_: bool) -> None:
    """Rank 0's (or the spawning process's) report of every rank, --json and --save with every rank's calls, and
    its exit status."""
    from maskcli.checks.registry import wrong
    from maskcli.render import labelled
    from maskcli.render.trace import views

    failures = merged.failures()
    console = make_console(stderr=True)
    for view in views(merged.groups, len(merged.calls), title, status, failures):
        console.print(view)
    for line in merged.lines():
        console.print(labelled(line))
    if expectations and not failures:
        console.print(labelled(f"--expect: every call of every rank matched holds ({len(expectations)} expectation{'s' if len(expectations) != 1 else ''})"))
    write_files(targets, {"--json": json_path, "--save": save}, merged.json(program, status) if json_path else None,
                merged.calls, merged.masks, ranks=merged.ranks(), said=_ranks(len(merged.parts), merged.world))
    if status:
        raise typer.Exit(status)
    if failures or merged.missing or (check_ and any(wrong(group.findings) for group in merged.groups)):
        raise typer.Exit(1)
    raise typer.Exit(0)


def write_files(targets: dict, shown: dict, data: dict | None, calls: list, masks: dict, extra_calls: list = (),
                ranks: list | None = None, said: str = "") -> None:
    """trace's --json (`data`) and --save (the calls with `extra_calls`, each mask they use once), each written whole
    or not at all, and a line on stderr naming each file as the user gave it (`shown`)."""
    import json

    from maskcli.commands.app import done
    from maskcli.files import atomic_write
    from maskcli.tracefile import save as save_trace

    if "--json" in targets:
        def write_json(path: str) -> None:
            with open(path, "w", encoding="utf-8") as out:
                json.dump(data, out, indent=1, default=str)

        atomic_write(targets["--json"], write_json)
        done(f"wrote {shown['--json']}{said}")
    if "--save" in targets:
        rows = [call.json() for call in calls] + list(extra_calls)
        used = {row["mask"] for row in rows if row.get("mask") is not None}
        kept = {key: value for key, value in masks.items() if key in used}
        atomic_write(targets["--save"], lambda path: save_trace(path, rows, kept, ranks))
        done(f"wrote {shown['--save']}{said}")


def _ranks(parts: int, world: int) -> str:
    """' (2 ranks)', or ' (1 rank of 2)' where a rank sent no part."""
    return f" ({parts} rank{'s' if parts != 1 else ''}{f' of {world}' if parts < world else ''})"
