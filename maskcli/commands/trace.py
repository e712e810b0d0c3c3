"""`maskcli trace SCRIPT.py [ARGS]...`: run a program and report the mask of every attention call it makes."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import MaskcliCommand, app, done, make_console
from maskcli.commands.options import Check, examples, integer
from maskcli.errors import MaskError

from maskcli.trace.apis import APIS  # (no torch: --help lists them)


def complete_apis(incomplete: str) -> list[str]:
    """--api's names: the last one typed after a comma, completed."""
    head, comma, word = incomplete.rpartition(",")
    return [head + comma + name for name in APIS if name.startswith(word) and name not in head.split(",")]


class TraceCommand(MaskcliCommand):
    """trace's options end at -m MODULE as python's do: `-m pkg -m other` runs pkg with the arguments -m other (the
    second -m was taken as trace's own, and the program run was another)."""

    VALUED = ("--api", "--max-bytes", "--json", "--save", "--rank-timeout", "--expect")

    def parse_args(self, ctx, args):
        for at, word in enumerate(args):
            if at and args[at - 1] in self.VALUED or word == "--":
                continue
            if word in ("-m", "--module"):
                cut = at + 2
            elif word.startswith("--module=") or (word.startswith("-m") and not word.startswith("--")):
                cut = at + 1
            elif word.startswith("-"):
                continue
            else:  # the script: what follows it is the program's already
                break
            rest = super().parse_args(ctx, list(args[:cut]))
            ctx.args = [*ctx.args, *args[cut:]]
            return rest
        return super().parse_args(ctx, args)


@app.command(
    cls=TraceCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=examples(
        "maskcli trace -m maskcli.trace.demo",
        "maskcli trace -m maskcli.trace.demo --len 8 --steps 1  # arguments after the program are the program's",
        "maskcli trace --expect \"layers.*.self_attn=window(4)\" -m maskcli.trace.demo",
        "maskcli trace --save demo.pt --json demo.json -m maskcli.trace.demo",
        "maskcli show --mask demo.pt:layers.1.self_attn@2",
        "torchrun --nproc-per-node 2 --no-python maskcli trace train.py  # every rank traced, one report (docs/ranks.md)",
    ),
)
def trace(
    ctx: typer.Context,
    script: Annotated[str | None, typer.Argument(help="The Python script to run, followed by its own arguments (passed as they are). THIS RUNS THE PROGRAM, in this process, as python would.", show_default=False, metavar="SCRIPT.py [ARGS]...")] = None,
    module: Annotated[str | None, typer.Option("-m", "--module", metavar="MODULE", help="Run a module as python -m does, instead of a script; the words after it are its arguments.", show_default=False)] = None,
    api: Annotated[str, typer.Option("--api", metavar="NAMES", help="Which calls to record, comma-separated: sdpa (scaled dot product attention), flex (flex_attention), mha (nn.MultiheadAttention, functional too), softmax (over the key axis of q @ kᵀ scores, 3-D/4-D or in an axis order an einsum or permute states, as Transformer-XL's (Lq, Lk, B, H); masked where -inf, the dtype's lowest, or a finite fill: at most -1e4, or a whole number at most -100 softmax weighs 0, as -1000.0), flash (flash_attn's functions, if the program imports it: the mask their causal, window_size and cu_seqlens / cache_seqlens mean, bottom-right), hf (Hugging Face's AttentionInterface, if the program imports transformers: each call's layer_idx, sliding_window, position_ids, cu_seq_lens noted on its kernel call, or recorded as api hf where none is seen), vllm (vLLM in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0: each step's CommonAttentionMetadata, checked as maskcli serve checks a file).", show_default="all of them", autocompletion=complete_apis)] = ",".join(APIS),
    max_bytes: Annotated[int, typer.Option("--max-bytes", help="Bytes of distinct masks kept; past it, calls keep shape and count only (it says so).", parser=integer)] = 256 << 20,
    json_path: Annotated[str | None, typer.Option("--json", metavar="FILE", help="Write every call (where, api, step, shapes, dtype, device, its mask's id) and every group, named, with findings, as JSON to this file (stdout stays the program's).", show_default=False)] = None,
    save: Annotated[str | None, typer.Option("--save", metavar="FILE", help="Write the captured calls to one .pt file that other commands read as a mask: --mask TRACE.pt:7 (call 7) or TRACE.pt:PATH@STEP (like layers.5.self_attn@2: that module's third call).", show_default=False)] = None,
    rank_timeout: Annotated[float, typer.Option("--rank-timeout", help="Under a launcher of several ranks (torchrun, mpirun: RANK and WORLD_SIZE, OMPI_COMM_WORLD_RANK, PMI_RANK), the seconds rank 0 waits for the other ranks' parts, after its own program ends, before it reports the ranks that sent none.", show_default=True)] = 120.0,
    expect: Annotated[list[str] | None, typer.Option("--expect", help="PATTERN=EXPR, repeatable: every call whose module path matches PATTERN (a shell pattern: layers.*.self_attn) must be EXPR; exit status 1 where one is not. What the run states is held at every step, as the checks read it: where its queries sit (its cache; cross-attention apart) and its padding (the model call's attention_mask, else the call's key_padding_mask, else what its prefill masks), padding query rows left out. EXPR says the rest, and may state the padding as trace's names end: causal (--lengths 2,4 --pad left).", show_default=False)] = None,
    check_: Check = True,
) -> None:
    """Run a Python program and record the mask of every attention call it makes, grouped and named.

    The program runs in this process as `python SCRIPT.py ARGS` (or `python -m MODULE ARGS`) would: its own sys.argv and __main__, its stdout untouched, its exit status kept (a program that raises prints its traceback and exits 1). The report goes to stderr: calls whose masks are the same form one row (the first 100 rows named and checked one by one, the rest counted in one line; --json lists them all), named as a maskcli expression with findings (where a mask differs from what the run states: its config, its model call's arguments, its earlier steps, the kernels' own rules), then what it could not see: threads running before it, child processes, torch.compile'd code with fullgraph=True (TORCHDYNAMO_DISABLE=1 runs it eagerly, traced). maskcli's options come before the program.
    """
    import os

    from maskcli.trace.expect import parse as parse_expect
    from maskcli.trace.run import check_program

    program_args = list(ctx.args)
    if module is not None and script is not None:
        program_args.insert(0, script)
        script = None
    for flag, value, suffix in (("--json", json_path, "json"), ("--save", save, "pt")):
        if script is None and module is None and value is not None and value.endswith(".py"):  # taken for a flag, as in show
            raise MaskError(f"{flag} takes a file name: maskcli trace {flag} run.{suffix} {value}")
    apis = tuple(part.strip() for part in api.split(",") if part.strip())
    unknown = [name for name in apis if name not in APIS]
    if unknown or not apis:
        raise MaskError(f"--api {api!r}: choose from {', '.join(APIS)}, comma-separated")
    if max_bytes < 0:
        raise MaskError(f"--max-bytes {max_bytes}: give 0 or more bytes")
    if not 0 <= rank_timeout < float("inf"):  # (NaN too)
        raise MaskError(f"--rank-timeout {rank_timeout:g}: give 0 or more seconds, a finite number")
    expectations = parse_expect(expect or [])
    from maskcli.files import check_output_path

    # checked before the program runs, and made absolute: the program may change the working folder
    targets = {flag: check_output_path(path, (suffix,), flag).absolute()  # (a folder no file can be made in: refused now)
               for flag, path, suffix in (("--save", save, ".pt"), ("--json", json_path, ".json")) if path is not None}
    check_program(script, module)  # last: -m a.b imports package a, as python -m does, once every option is good

    import sys

    from maskcli.trace.ranks import ProcessGroups, job as rank_job

    job = rank_job(list(targets.values()), sys.argv[1:])  # one rank of several: its part goes beside the target
    if job is not None:
        job.begin()

    import contextlib

    from maskcli.commands.app import OWN_PROCESS, SIGNALS, outcome
    from maskcli.trace.capture import Trace
    from maskcli.trace.ending import Exits, alone, finish as python_exit, join_threads, others
    from maskcli.trace.run import World, run_program

    from maskcli.trace.spawned import Spawns

    program = f"-m {module}" if module else os.path.basename(script)
    tracer = Trace(apis, max_bytes)
    spawns = Spawns(apis, max_bytes, program, expectations, tracer)  # processes the program spawns: each traced as a rank
    world = World(SIGNALS)  # the program's signal handlers while it runs; maskcli's streams and limits after it
    spare = _spare_stderr()

    def finish(status: int) -> None:
        _reopen_stderr(spare)
        named = apis if api != ",".join(APIS) else ()  # the APIs the user asked for by name
        unseen = [f"--api {name}: the program never imported {module_name}, so --api {name} recorded nothing"
                  for name, module_name in (("flash", "flash_attn"), ("hf", "transformers"), ("vllm", "vllm")) if name in named and name not in tracer.patched]
        if job is not None:
            from maskcli.commands.traceranks import report_ranks

            report_ranks(tracer, job, groups, program, status, expectations, json_path, save, targets, unseen, check_, rank_timeout)
        if spawns.world:
            from maskcli.commands.traceranks import report_spawned

            report_spawned(tracer, spawns, program, status, expectations, json_path, save, targets, check_, rank_timeout)
        _report(tracer, program, status, expectations, json_path, save, targets, unseen, check_)

    def exiting(status: int) -> int:  # the program's os._exit(status): the trace ends there, and reports, as it would
        world.flush = False  # (python's os._exit flushes nothing: what the program left unflushed is lost there too)
        stack.close()
        return alone(lambda: outcome(lambda: finish(status)), (tracer,)) if OWN_PROCESS else outcome(lambda: finish(status))

    import threading

    before = set(threading.enumerate())
    with contextlib.ExitStack() as stack:
        groups = ProcessGroups(lambda: len(tracer.calls))
        for context in (world, tracer, groups, spawns, Exits(exiting)):
            stack.enter_context(context)
        status = run_program(script, module, program_args)
        if job is not None:  # (a launcher's SIGTERM from now on: the ranks' report still comes out)
            job.ended(world)
        join_threads(before)  # (python's exit joins them before its atexit functions; their calls are the program's)
    if world.unflushed:  # the program's stdout or stderr raised when flushed at its end: python exits 120
        status = 120
    if world.forked():  # a child the program forked, back from its code: it exits as it would, its parent reports
        raise typer.Exit(status)
    if OWN_PROCESS and others():  # daemon threads: held where the program's end left them while the report is
        from maskcli.trace import run  # written, as python's exit stops them (a KeyboardInterrupt's end is main()'s)

        raise typer.Exit(alone(lambda: outcome(lambda: finish(status)), (tracer,), None if run.interrupted else python_exit))
    finish(status)


def _spare_stderr() -> int | None:
    """A copy of file descriptor 2, kept for the report where the program closes sys.stderr (python's own stream on
    descriptor 2 does not close it, but the object is closed)."""
    import os

    try:
        return os.dup(2)
    except OSError:  # (started with stderr closed: 2>&-)
        return None


def _reopen_stderr(spare: int | None) -> None:
    """The report's stderr: the one maskcli started with, or a new stream on the copy where the program closed it."""
    import os
    import sys

    if spare is None:
        return
    if sys.stderr is not None and not sys.stderr.closed and _open(sys.stderr):
        os.close(spare)
        return
    sys.stderr = open(spare, "w", encoding="utf-8", errors="replace", closefd=True)  # noqa: SIM115 - open until exit


def _open(stream) -> bool:
    """The stream's descriptor is still open: a program's os.close(2) leaves sys.stderr looking open."""
    import os

    try:
        descriptor = stream.fileno()
    except Exception:  # noqa: BLE001 - no descriptor (a StringIO, io.UnsupportedOperation): none to lose
        return True
    try:
        os.fstat(descriptor)
    except OSError:
        return False
    return True


def _report(tracer, program: str, status: int, expectations, json_path: str | None, save: str | None, targets: dict,
            unseen: list[str], check_: bool = True) -> None:
    from maskcli.checks.registry import wrong
    from maskcli.commands.traceranks import write_files
    from maskcli.render import labelled
    from maskcli.render.trace import views
    from maskcli.trace.expect import check

    groups = tracer.groups()
    served, followed, served_calls, served_masks, notes = [], [], [], {}, []
    if "vllm" in tracer.patched:
        from maskcli.serve import traced
        from maskcli.serve.captured import check_steps

        served = check_steps(tracer.vllm.steps)
        followed, notes = traced.across(served)
        if save is not None or json_path is not None:  # (each request's mask stored: only for the files that hold them)
            served_calls, served_masks = traced.calls(served, len(tracer.calls), tracer.max_bytes - tracer.bytes)
    failures = _expect(tracer.calls, served, expectations, tracer.tops) if expectations else []
    held = [f"--expect: every call matched holds ({len(expectations)} expectation{'s' if len(expectations) != 1 else ''})"] if expectations and not failures else []
    console = make_console(stderr=True)
    for view in views(groups, len(tracer.calls), program, status, failures):
        console.print(view)
    if served:
        from maskcli.render.serve import traced_steps

        for view in traced_steps(served, followed):
            console.print(view)
    notes = tracer.notes() + notes  # threads traced, and what was not: threads running before, child processes
    if "vllm" in tracer.patched:
        notes += [f"--api vllm: {line}, not read" for line in tracer.vllm.failed]
        notes += [f"--api vllm: {count} build{'s' if count != 1 else ''} of {name} not read: not a decoder's paged self-attention"
                  for name, count in tracer.vllm.skipped.items()]
    for line in unseen + notes + held:
        console.print(labelled(line))
    data = None
    if json_path is not None:
        numbers = {call.index: number for number, group in enumerate(groups) for call in group.calls}
        data = {"program": program, "exit_status": status,
                "calls": [{**call.json(), "group": numbers[call.index]} for call in tracer.calls] + [{**call, "group": None} for call in served_calls],
                "groups": [group.json() for group in groups], "expect": failures, "not_imported": unseen,
                "notes": notes}
        if "vllm" in tracer.patched:
            from maskcli.render.serve import finding_json, traced_json

            data["vllm"] = traced_json(served)
            data["vllm_across_steps"] = [{"layers": where, **finding_json(f)} for where, found in followed for f in found]

    write_files(targets, {"--json": json_path, "--save": save}, data, tracer.calls, tracer.masks | served_masks,
                served_calls)
    if status:
        raise typer.Exit(status)
    served_wrong = any(c.batch is None or wrong(c.findings) for c in served) or bool(wrong([f for _, found in followed for f in found]))
    if failures or (check_ and (served_wrong or any(wrong(group.findings) for group in groups))):
        raise typer.Exit(1)


def _expect(calls: list, served: list, expectations: list[tuple[str, str]], tops: list) -> list[str]:
    """trace's --expect lines over the program's calls and a traced vLLM engine's steps: a pattern is compared with
    every call and every step it matches, and is a failure where it matches neither."""
    from fnmatch import fnmatchcase

    from maskcli.serve import traced
    from maskcli.trace.expect import check, stated_padding

    lines = []
    for pattern, expression in expectations:
        steps = traced.matched(served, pattern)
        if steps and stated_padding(expression)[1]:
            lines.append(f"--expect {pattern}={expression}: the vLLM steps it matches hold no padding (each request is one "
                         f"sequence): give the expression without one")
        elif steps:
            lines += traced.expect(served, pattern, expression)
        if not served or any(fnmatchcase(call.where, pattern) for call in calls):
            lines += check(calls, [(pattern, expression)], tops=tops)  # (which says so where no call matches)
        elif not steps:
            known = sorted({call.where for call in calls} | {name for c in served for name in traced.names(c)})
            shown = ", ".join(known[:6]) + (", ..." if len(known) > 6 else "")
            lines.append(f"--expect {pattern}={expression}: no call matches {pattern!r} (calls came from {shown})")
    return lines
