"""Cost of `maskcli trace` on a program: a small decoder run traced and untraced, in the same run, on the CPU.

    python benchmarks/trace.py [--runs 15] [--len 128] [--steps 8] [--layers 4] [--threads 1] [--no-hf]

The program is maskcli.trace.demo's decoder (random weights): a batch of 2 prompts with
left padding, prefill then --steps decode steps with a KV cache, every layer calling SDPA
with a sliding-window mask (the model builds the mask once per step and hands it to every
layer, as decoders do). Traced means inside `maskcli.trace()`: torch's attention entry points, and the
products, casts and sums the trace watches, are wrapped (trace/entry.py; the rest of torch runs untouched,
and a TorchFunctionMode is on only while a tensor it follows is alive), each call's stack is walked once for
every reader of it (trace/walk.py: the modules running, the padding and the window its frames hold, the call
site's line; hooks only on the outermost module; a module no running one holds is looked for from its caller
outward), K and V are read for zero-keys-seen only at the edges of each row's keys (trace/zerokv.py: one element a
head, K's read cell by cell at its address on the CPU where the heads are few, else through numpy; V only where K's
edge may be zero), and each step's mask is copied (its own cells) to be read after the run, each distinct content
once (trace/store.py). docs/python.md gives the figures of each round (and what each attempt to make a call do less
measured in place); benchmarks/zerokv.py times the K/V reading over a static cache of 64k slots, and
benchmarks/trace_steps.py each step of a traced call of the tiny generate below, in place (where its ~8 ms go: about
a quarter once a trace, an eighth the Tops, a quarter the wrappers and the program run colder), with the bound of a
call-site cache of the readers (--bound: 0.1-0.6 ms a generate, so not built).
The two sides alternate run by run, so a slow spell on a shared machine hits both; each run is
timed by the wall clock and by this process's CPU time (steadier where other programs share the
cores). It prints the median of each side and the median of the paired ratios with quartiles
(target <= 1.5), by both clocks, and trace's cost a call: (traced - untraced) / calls by the CPU
clock, median and quartiles of the pairs (target <= 0.2 ms). Then what trace does after the run and
what the checks (maskcli.checks: the rules that read the run) add to the report: each traced run
is reported as `maskcli trace` reports it: the configs its model states read (Trace.settle: read after
the run, not while it runs), the masks copied at the calls read (Trace.calls), its groups named
(trace/report.py), and then checked; the checks' time
over trace's whole overhead (traced run less untraced, plus the configs, the masks and naming the groups), by
the CPU clock, median and quartiles (target <= 10%).

Then a tiny Hugging Face llama (LlamaConfig, random weights, 2 layers, batch 2 with left padding):
`generate` of 3 new tokens (6 attention calls) inside `maskcli.trace()` against the same generate
untraced, pairs alternating as above, the median of the paired ratios by both clocks (target <= 1.25x), and
the time its masks and its model calls' Tops take to read once the run is over (not in the ratio: after the run, as
the report reads them; a Top handed only plain values and small integer tensors is made then, trace/later.py);
beside it the same generate inside a TorchFunctionMode that does nothing but call each function, the
floor of any trace that sees every torch call from Python (each of its ~850 calls pays the mode's
dispatch). Skipped where transformers is not installed, or with --no-hf.

Then many distinct masks: a program that hands F.scaled_dot_product_attention --distinct random (1, 1, 8, 8) boolean
masks in turn over --many-calls calls (3,000 over 20,000 by default: trace named and checked each group, ~10 ms a group,
and printed every one, minutes in all), run as a process alone (`python PROGRAM`) and under `maskcli trace PROGRAM`,
--many-runs pairs alternating, each timed by the children's CPU clock (OMP_NUM_THREADS=1, as --threads 1: a second
thread's spin counts as CPU); the median of the paired ratios (target <= 5x: a small multiple of the program, imports
and all), and of the loop alone in this process (its calls traced, then reported as `maskcli trace` reports them:
read, grouped, the first 100 groups named and checked, the rest counted, rendered), against the loop untraced.

    python benchmarks/trace.py --ranks 2 [--runs 15] ...

The same decoder in each of 2 ranks under torchrun (gloo, CPU) against 2 processes alone, started at once
(so that both sides share the machine's cores alike): each process
alternates untraced runs with traced ones that do what `maskcli trace` does under a launcher (the calls
recorded, the groups named and checked, and, under torchrun, each rank's part written and rank 0 waiting for
every part and merging them: trace/ranks.py, trace/merged.py). Trace's cost per call is (traced - untraced) /
calls, by the CPU clock; it prints each side's median, and torchrun's over the lone processes' as a ratio
(target <= 1.1x: under a launcher trace adds no more a call than alone, within a shared machine's noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import maskcli
from maskcli.trace.demo import Decoder, window_mask

TARGET = 1.5
PER_CALL_TARGET = 0.2e-3  # seconds of trace's cost an attention call
HF_TARGET = 1.25  # a tiny HF model's generate, traced over untraced
CHECKS_TARGET = 0.10
RANKS_TARGET = 1.1
MANY_TARGET = 5.0  # the many-masks program under `maskcli trace` over the program alone, as processes

MANY = """
import sys
import torch
import torch.nn.functional as F

torch.manual_seed(0)
distinct, calls = int(sys.argv[1]), int(sys.argv[2])
masks = [torch.rand(1, 1, 8, 8) > 0.5 for _ in range(distinct)]
q = torch.randn(1, 2, 8, 16)
for i in range(calls):
    F.scaled_dot_product_attention(q, q, q, attn_mask=masks[i % distinct])
"""


def generate(model, ids, steps: int, window: int) -> None:
    real = ids != 0
    caches = [[] for _ in model.layers]
    with torch.no_grad():
        logits = model(ids, window_mask(real, ids.shape[1], window), caches)
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)], dim=1)
            logits = model(token, window_mask(real, 1, window), caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--no-hf", action="store_true", help="leave out the tiny Hugging Face generate")
    parser.add_argument("--distinct", type=int, default=3000, help="distinct masks of the many-masks program")
    parser.add_argument("--many-calls", type=int, default=20000, help="its attention calls")
    parser.add_argument("--many-runs", type=int, default=3, help="its pairs of runs (0: leave it out)")
    parser.add_argument("--ranks", type=int, default=None, help="compare trace's cost a call under torchrun with this many ranks against one process")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # (a worker of --ranks: where its numbers go)
    args = parser.parse_args()
    if args.runs < 2 or args.many_runs == 1:  # (medians and quartiles of one sample say nothing)
        parser.error("--runs is 2 or more, and --many-runs 0 (left out) or 2 or more")
    if args.ranks is not None:
        return ranked(args)
    if args.out is not None:
        return worker(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder(vocab=1000, dim=256, heads=4, layers=args.layers).eval()
    ids = torch.randint(1, 1000, (2, args.len))
    ids[1, : args.len // 4] = 0

    def plain() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        generate(model, ids, args.steps, args.window)
        return time.perf_counter() - wall, time.process_time() - cpu

    reports = []  # per traced run: (seconds reading configs and masks and naming the groups, seconds checking them)
    calls = args.layers * (args.steps + 1)

    def traced() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with maskcli.trace() as t:
            generate(model, ids, args.steps, args.window)
        elapsed = time.perf_counter() - wall, time.process_time() - cpu
        reports.append(report(t))
        assert len(t.calls) == calls
        return elapsed

    plain(), traced()  # warm-up: first calls allocate and import
    reports.clear()
    samples = [(plain(), traced()) for _ in range(args.runs)]
    print(f"decoder: {args.layers} layers, batch 2, prompt {args.len}, {args.steps} decode steps, {args.runs} runs, "
          f"{torch.get_num_threads()} threads")
    for clock, which in (("wall", 0), ("cpu", 1)):
        untraced = [a[which] for a, _ in samples]
        traced_times = [b[which] for _, b in samples]
        ratios = [b[which] / a[which] for a, b in samples]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(f"{clock:>4}: untraced median {statistics.median(untraced) * 1e3:.1f} ms, traced median "
              f"{statistics.median(traced_times) * 1e3:.1f} ms; traced / untraced median {median:.2f}x "
              f"(quartiles {q1:.2f}-{q3:.2f}), target <= {TARGET}x: {'met' if median <= TARGET else 'NOT met'}")
    costs = [(b[1] - a[1]) / calls for a, b in samples]
    q1, median, q3 = statistics.quantiles(costs, n=4)
    print(f"a call: trace costs {median * 1e3:.3f} ms by the CPU clock, median of (traced - untraced) / {calls} calls "
          f"(quartiles {q1 * 1e3:.3f}-{q3 * 1e3:.3f}), target <= {PER_CALL_TARGET * 1e3:.1f} ms: "
          f"{'met' if median <= PER_CALL_TARGET else 'NOT met'}")
    shares = [checking / (b[1] - a[1] + after) for (a, b), (after, checking) in zip(samples, reports)]
    q1, median, q3 = statistics.quantiles(shares, n=4)
    print(f"checks: median {statistics.median(c for _, c in reports) * 1e3:.2f} ms a run (after the run, reading the "
          f"configs and masks and naming the groups {statistics.median(n for n, _ in reports) * 1e3:.1f} ms); checks / trace's "
          f"overhead median {median:.1%} (quartiles {q1:.1%}-{q3:.1%}), target <= {CHECKS_TARGET:.0%}: "
          f"{'met' if median <= CHECKS_TARGET else 'NOT met'}")
    if not args.no_hf:
        hf_generate(args.runs)
    if args.many_runs:
        many(args.distinct, args.many_calls, args.many_runs)


def many(distinct: int, calls: int, runs: int) -> None:
    """The many-masks program (MANY) as processes, alone and under `maskcli trace`, and its loop in this process."""
    import io
    import resource

    from rich.console import Console

    from maskcli.checks.context import Run
    from maskcli.checks.engine import apply
    from maskcli.render.trace import views
    from maskcli.trace.report import group

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}

    def child(command: list) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert done.returncode in (0, 1), done.stderr[-2000:]  # (1: trace's findings on random masks, as it should)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    with tempfile.TemporaryDirectory() as folder:
        program = os.path.join(folder, "many.py")
        with open(program, "w") as out:
            out.write(MANY)
        words = [program, str(distinct), str(calls)]
        pairs = [(child([sys.executable, *words]), child([sys.executable, "-m", "maskcli", "trace", *words])) for _ in range(runs)]
    ratios = sorted(b / a for a, b in pairs)
    print(f"many masks: {distinct:,} distinct (1,1,8,8) masks over {calls:,} SDPA calls, {runs} pairs of processes (CPU clock): "
          f"alone median {statistics.median(a for a, _ in pairs):.2f} s, under maskcli trace {statistics.median(b for _, b in pairs):.2f} s; "
          f"median ratio {statistics.median(ratios):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}), target <= {MANY_TARGET}x: "
          f"{'met' if statistics.median(ratios) <= MANY_TARGET else 'NOT met'}")
    torch.manual_seed(0)
    masks = [torch.rand(1, 1, 8, 8) > 0.5 for _ in range(distinct)]
    q = torch.randn(1, 2, 8, 16)

    def loop() -> None:
        for i in range(calls):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=masks[i % distinct])

    start = time.process_time()
    loop()
    plain = time.process_time() - start
    start = time.process_time()
    with maskcli.trace() as t:
        loop()
    recorded = time.process_time() - start
    start = time.process_time()
    groups = apply(group(t.calls), Run(t.calls, t.tops))
    console = Console(file=io.StringIO(), width=100)
    for view in views(groups, len(t.calls), "many.py", 0):
        console.print(view)
    reported = time.process_time() - start
    print(f"  its loop in this process: {plain:.2f} s untraced, {recorded:.2f} s traced ({(recorded - plain) / calls * 1e6:.0f} us a call) "
          f"+ {reported:.2f} s reported ({len(groups):,} groups, {sum(g.named for g in groups)} named): "
          f"{(recorded + reported) / plain:.1f}x the loop")


def tiny_llama(LlamaConfig, LlamaForCausalLM):  # noqa: N803 - transformers' classes, imported by the caller
    """The tiny llama the generate figures use (2 layers, seed 0), with its left-padded rows of ids and their mask."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, pad_token_id=0)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    return LlamaForCausalLM(config).eval(), ids, (ids != 0).long()


def hf_generate(runs: int) -> None:
    """A tiny llama's generate (6 attention calls) traced, untraced, and inside a mode that does nothing: the ratios."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("tiny HF generate: skipped (transformers is not installed)")
        return
    from torch.overrides import TorchFunctionMode

    class Nothing(TorchFunctionMode):  # the floor: every torch call through a Python mode, and nothing else
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    transformers.logging.set_verbosity_error()
    model, ids, mask = tiny_llama(LlamaConfig, LlamaForCausalLM)

    def run(context) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with context:
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        return time.perf_counter() - wall, time.process_time() - cpu

    after = []  # CPU seconds a traced run's recorded calls and tops take to read once it is over (the masks copied at
    # the calls, the Tops made once the run is over: trace/later.py)

    def traced() -> tuple[float, float]:
        t = maskcli.trace()
        elapsed = run(t)
        start = time.process_time()
        assert len(t.calls) == 6 and len(t.tops) == 3, (len(t.calls), len(t.tops))
        after.append(time.process_time() - start)
        return elapsed

    import contextlib

    for _ in range(2):  # warm-up: first calls allocate, import and fill caches
        run(contextlib.nullcontext()), traced(), run(Nothing())
    after.clear()
    samples = [(run(contextlib.nullcontext()), traced(), run(Nothing())) for _ in range(max(runs, 4) * 2)]
    print(f"tiny HF llama generate (2 layers, 3 new tokens, 6 attention calls), {len(samples)} runs (after a traced run, "
          f"its masks and tops read: median {statistics.median(after) * 1e3:.2f} ms by the CPU clock):")
    for clock, which in (("wall", 0), ("cpu", 1)):
        plain = statistics.median(a[which] for a, _, _ in samples)
        ratios = [b[which] / a[which] for a, b, _ in samples]
        floor = statistics.median(c[which] / a[which] for a, _, c in samples)
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(f"{clock:>4}: untraced median {plain * 1e3:.1f} ms; traced / untraced median {median:.2f}x (quartiles "
              f"{q1:.2f}-{q3:.2f}), target <= {HF_TARGET}x: {'met' if median <= HF_TARGET else 'NOT met'}; "
              f"a mode that does nothing: {floor:.2f}x")


def report(t) -> tuple[float, float]:
    """CPU seconds of trace's work after the run as the report does it (the configs the model states read, the masks
    copied at the calls read, the groups named), and CPU seconds running the checks over them."""
    from maskcli.checks.context import Run
    from maskcli.checks.engine import apply
    from maskcli.trace.report import group

    start = time.process_time()
    t.settle()
    groups = group(t.calls)  # (t.calls: the masks copied at the calls read first)
    named = time.process_time()
    apply(groups, Run(t.calls, t.tops))
    return named - start, time.process_time() - named


def ranked(args) -> None:
    """One process alone, then --ranks processes under torchrun, each a worker; their costs a call compared."""
    own = [f"--{name}={getattr(args, name)}" for name in ("runs", "len", "steps", "layers", "window", "threads")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH")]))
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        # alone: as many plain processes at once as torchrun starts ranks, so that both sides share the cores alike
        outs = [os.path.join(folder, f"alone{i}.json") for i in range(args.ranks)]
        running = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *own, "--out", out], env=env) for out in outs]
        for process in running:
            assert process.wait() == 0
        found["1 process"] = _pooled([json.loads(open(out).read()) for out in outs])
        out = os.path.join(folder, "ranks.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port", str(_free_port()),
                        os.path.abspath(__file__), *own, "--out", out], check=True, env=env)
        found[f"{args.ranks} ranks"] = json.loads(open(out).read())
    alone, together = found["1 process"], found[f"{args.ranks} ranks"]
    print(f"decoder: {args.layers} layers, batch 2, prompt {args.len}, {args.steps} decode steps, {args.runs} runs a process, "
          f"{alone['calls']} calls a run; trace's cost a call (traced - untraced) / calls, CPU clock, medians")
    for label, data in found.items():
        label = f"{args.ranks} x alone" if label == "1 process" else label
        print(f"{label:>9}: untraced {data['untraced'] * 1e3:.1f} ms a run, traced {data['traced'] * 1e3:.1f} ms; "
              f"{data['per_call'] * 1e6:.0f} us a call (quartiles {data['q1'] * 1e6:.0f}-{data['q3'] * 1e6:.0f})")
    ratio = together["per_call"] / alone["per_call"]
    print(f"{args.ranks} ranks / {args.ranks} lone processes at once, a call: {ratio:.2f}x, target: no more than alone (<= {RANKS_TARGET}x, the noise "
          f"of a shared machine): {'met' if ratio <= RANKS_TARGET else 'NOT met'}")


def _pooled(runs: list[dict]) -> dict:
    """The numbers of several processes run at once, as one: the medians of their costs a call."""
    costs = sorted(c for run in runs for c in run["costs"])
    q1, median, q3 = statistics.quantiles(costs, n=4)
    return {"calls": runs[0]["calls"], "per_call": median, "q1": q1, "q3": q3, "costs": costs,
            "untraced": statistics.median(run["untraced"] for run in runs), "traced": statistics.median(run["traced"] for run in runs)}


def worker(args) -> None:
    """Alternate untraced and traced runs in this process (a rank of torchrun's, or alone): the numbers to args.out."""
    from pathlib import Path

    from maskcli.trace.merged import merge, part
    from maskcli.trace.ranks import Job, ProcessGroups, job as rank_job

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder(vocab=1000, dim=256, heads=4, layers=args.layers).eval()
    ids = torch.randint(1, 1000, (2, args.len))
    ids[1, : args.len // 4] = 0
    launched = rank_job([], ["benchmark", os.environ.get("MASTER_PORT", "")])
    folder = Path(tempfile.gettempdir()) / f"maskcli-bench-{os.environ.get('MASTER_PORT', os.getpid())}"

    def plain() -> float:
        cpu = time.process_time()
        generate(model, ids, args.steps, args.window)
        return time.process_time() - cpu

    def traced(number: int) -> tuple[float, int]:
        cpu = time.process_time()
        with maskcli.trace() as t, ProcessGroups(lambda: len(t.calls)) as watched:
            generate(model, ids, args.steps, args.window)
        groups = t.groups()  # as maskcli trace reports: named and checked
        if launched is not None:  # each rank's part written; rank 0 waits for every part and merges them
            here = Job(launched.rank, launched.world, launched.local_rank, launched.launcher, folder / str(number))
            here.begin()
            mine = part(t, groups, 0, "benchmark", [], [], [], here, watched)
            if here.rank:
                here.write(mine)
            else:
                others, missing = here.gather(120)
                assert not missing, missing
                merge({0: mine, **others}, missing, here.world).lines()
                here.clean()
        return time.process_time() - cpu, len(t.calls)

    plain(), traced(-1)  # warm-up
    samples = [(plain(), *traced(number)) for number in range(args.runs)]
    costs = [(b - a) / calls for a, b, calls in samples]
    q1, median, q3 = statistics.quantiles(costs, n=4)
    if launched is None or launched.rank == 0:
        Path(args.out).write_text(json.dumps({"calls": samples[0][2], "per_call": median, "q1": q1, "q3": q3, "costs": costs,
                                              "untraced": statistics.median(a for a, _, _ in samples),
                                              "traced": statistics.median(b for _, b, _ in samples)}))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
