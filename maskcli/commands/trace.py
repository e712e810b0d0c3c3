"""`maskcli trace SCRIPT.py [ARGS]...`: run a program and report the mask of every attention call it makes."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, done, make_console
from maskcli.commands.options import Check, examples, integer
from maskcli.errors import MaskError

APIS = ("sdpa", "flex", "mha", "softmax", "flash", "hf", "vllm")  # maskcli.trace.capture.APIS, without importing torch for --help


def complete_apis(incomplete: str) -> list[str]:
    """--api's names: the last one typed after a comma, completed."""
    head, comma, word = incomplete.rpartition(",")
    return [head + comma + name for name in APIS if name.startswith(word) and name not in head.split(",")]


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=examples(
        "maskcli trace -m maskcli.trace.demo",
        "maskcli trace -m maskcli.trace.demo --len 8 --steps 1  # arguments after the program are the program's",
        "maskcli trace --expect \"layers.*.self_attn=window(4)\" -m maskcli.trace.demo",
        "maskcli trace --save demo.pt --json demo.json -m maskcli.trace.demo",
        "maskcli show --mask demo.pt:layers.1.self_attn@2",
    ),
)
def trace(
    ctx: typer.Context,
    script: Annotated[str | None, typer.Argument(help="The Python script to run, followed by its own arguments (passed as they are). THIS RUNS THE PROGRAM, in this process, as python would.", show_default=False, metavar="SCRIPT.py [ARGS]...")] = None,
    module: Annotated[str | None, typer.Option("-m", "--module", help="Run a module as python -m does, instead of a script; the words after it are its arguments.", show_default=False)] = None,
    api: Annotated[str, typer.Option("--api", help="Which calls to record, comma-separated: sdpa (scaled dot product attention), flex (flex_attention), mha (nn.MultiheadAttention and its functional form), softmax (a softmax over the last dimension of 3-D/4-D scores, masked where -inf, the dtype's lowest value, or one finite fill at most -1e4 such as masked_fill's -1e9), flash (flash_attn's functions, where the program imports flash_attn: the mask their causal, window_size and cu_seqlens / cache_seqlens mean, bottom-right aligned), hf (Hugging Face's AttentionInterface, where the program imports transformers: each call's layer_idx, sliding_window, position_ids, cu_seq_lens_q/k noted on the kernel call it makes, or recorded as api hf with the mask its arguments mean where no kernel call is seen), vllm (where the program imports vLLM, in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0; each step's CommonAttentionMetadata as its metadata builder gets it, read and checked as maskcli serve reads a file: each request's queries, keys and mask, and serve's findings).", show_default="all of them", autocompletion=complete_apis)] = ",".join(APIS),
    max_bytes: Annotated[int, typer.Option("--max-bytes", help="Bytes of distinct masks kept; past it a call keeps its shape and counts only, and says so.", parser=integer)] = 256 << 20,
    json_path: Annotated[str | None, typer.Option("--json", help="Write every call (where, api, step, shapes, dtype, device, its mask's id) and every group, named, with findings, as JSON to this file (stdout stays the program's).", show_default=False)] = None,
    save: Annotated[str | None, typer.Option("--save", help="Write the captured calls to one .pt file that other commands read as a mask: --mask TRACE.pt:7 (call 7) or TRACE.pt:PATH@STEP (like layers.5.self_attn@2: that module's third call).", show_default=False)] = None,
    expect: Annotated[list[str] | None, typer.Option("--expect", help="PATTERN=EXPR, repeatable: every call whose module path matches PATTERN (as a shell matches, like layers.*.self_attn) must be EXPR; exit status 1 where one is not. What the run states is held at every step, as the checks read it: where its queries sit (its cache; a cross-attention's apart from its memory) and its padding (the model call's attention_mask, else the call's key_padding_mask, else the keys its prefill masks as padding, else the keys no query of a batch row sees while one of another row does), a padding query's row left out. EXPR says the rest; the padding may be stated as it ends, like the names trace prints: causal (--lengths 2,4 --pad left), the prompt's keys held at every step, every row compared.", show_default=False)] = None,
    check_: Check = True,
) -> None:
    """Run a Python program and record the mask of every attention call it makes, grouped and named.

    The program runs in this process as `python SCRIPT.py ARGS` (or `python -m MODULE ARGS`) would: its own sys.argv and __main__, its stdout untouched, its exit status kept (a program that raises prints its traceback and exits 1). The report goes to stderr: calls whose masks are the same form one row, named as a maskcli expression with findings (rows that see no key and what the API makes of them, queries that see later keys, is_causal aligned top-left, a finite fill, is_causal or a sliding_window Hugging Face asked for that the kernel did not apply, an is_causal a fast path ignored), then what it could not see: threads running before it, child processes, torch.compile'd code (TORCHDYNAMO_DISABLE=1 runs that eagerly, traced). maskcli's options come before the program.
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
    check_program(script, module)
    apis = tuple(part.strip() for part in api.split(",") if part.strip())
    unknown = [name for name in apis if name not in APIS]
    if unknown or not apis:
        raise MaskError(f"--api {api!r}: choose from {', '.join(APIS)}, comma-separated")
    if max_bytes < 0:
        raise MaskError(f"--max-bytes {max_bytes}: give 0 or more bytes")
    expectations = parse_expect(expect or [])
    from maskcli.files import check_output_path

    # checked before the program runs, and made absolute: the program may change the working folder
    targets = {flag: check_output_path(path, (suffix,), flag).absolute()
               for flag, path, suffix in (("--save", save, ".pt"), ("--json", json_path, ".json")) if path is not None}

    from maskcli.trace.capture import Trace
    from maskcli.trace.run import run_program

    tracer = Trace(apis, max_bytes)
    with tracer:
        status = run_program(script, module, program_args)
    named = apis if api != ",".join(APIS) else ()  # the APIs the user asked for by name
    unseen = [f"--api {name}: the program never imported {module_name}, so --api {name} recorded nothing"
              for name, module_name in (("flash", "flash_attn"), ("hf", "transformers"), ("vllm", "vllm")) if name in named and name not in tracer.patched]
    _report(tracer, f"-m {module}" if module else os.path.basename(script), status, expectations, json_path, save, targets, unseen,
            check_)


def _report(tracer, program: str, status: int, expectations, json_path: str | None, save: str | None, targets: dict,
            unseen: list[str], check_: bool = True) -> None:
    import json

    from maskcli.checks.registry import wrong
    from maskcli.files import atomic_write
    from maskcli.render import labelled
    from maskcli.render.trace import views
    from maskcli.trace.expect import check

    groups = tracer.groups()
    served = []
    if "vllm" in tracer.patched:
        from maskcli.serve.captured import check_steps

        served = check_steps(tracer.vllm.steps)
    failures = check(tracer.calls, expectations, tops=tracer.tops) if expectations else []
    held = [f"--expect: every call matched holds ({len(expectations)} expectation{'s' if len(expectations) != 1 else ''})"] if expectations and not failures else []
    console = make_console(stderr=True)
    for view in views(groups, len(tracer.calls), program, status, failures):
        console.print(view)
    if served:
        from maskcli.render.serve import traced_steps

        for view in traced_steps(served):
            console.print(view)
    notes = tracer.notes()  # threads traced, and what was not: threads running before, child processes
    if "vllm" in tracer.patched:
        notes += [f"--api vllm: {line}, not read" for line in tracer.vllm.failed]
        notes += [f"--api vllm: {count} build{'s' if count != 1 else ''} of {name} not read: not a decoder's paged self-attention"
                  for name, count in tracer.vllm.skipped.items()]
    for line in unseen + notes + held:
        console.print(labelled(line))
    if json_path is not None:
        numbers = {call.index: number for number, group in enumerate(groups) for call in group.calls}
        data = {"program": program, "exit_status": status, "calls": [{**call.json(), "group": numbers[call.index]} for call in tracer.calls],
                "groups": [group.json() for group in groups], "expect": failures, "not_imported": unseen,
                "notes": notes}
        if "vllm" in tracer.patched:
            from maskcli.render.serve import traced_json

            data["vllm"] = traced_json(served)

        def write_json(path: str) -> None:
            with open(path, "w", encoding="utf-8") as out:
                json.dump(data, out, indent=1, default=str)

        atomic_write(targets["--json"], write_json)
        done(f"wrote {json_path}")
    if save is not None:
        from maskcli.tracefile import save as save_trace

        used = {call.mask for call in tracer.calls if call.mask is not None}
        masks = {key: value for key, value in tracer.masks.items() if key in used}
        atomic_write(targets["--save"], lambda path: save_trace(path, [call.json() for call in tracer.calls], masks))
        done(f"wrote {save}")
    if status:
        raise typer.Exit(status)
    served_wrong = any(c.batch is None or wrong(c.findings) for c in served)
    if failures or (check_ and (served_wrong or any(wrong(group.findings) for group in groups))):
        raise typer.Exit(1)
