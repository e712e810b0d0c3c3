"""Cost of `maskcli trace` on a program: a small decoder run traced and untraced, in the same run, on the CPU.

    python benchmarks/trace.py [--runs 15] [--len 128] [--steps 8] [--layers 4] [--threads 1]

The program is maskcli.trace.demo's decoder (random weights): a batch of 2 prompts with
left padding, prefill then --steps decode steps with a KV cache, every layer calling SDPA
with a sliding-window mask (the model builds the mask once per step and hands it to every
layer, as decoders do). Traced means inside `maskcli.trace()`: the TorchFunctionMode sees
every torch call, module hooks run for every module, and each step's mask is read and stored.
The two sides alternate run by run, so a slow spell on a shared machine hits both; each run is
timed by the wall clock and by this process's CPU time (steadier where other programs share the
cores). It prints the median of each side and the median of the paired ratios with quartiles
(target <= 1.5), by both clocks. Then what the checks (maskcli.checks: the rules that read the run)
add to the report: each traced run is reported as `maskcli trace` reports it, its groups named
(trace/report.py) and then checked; the checks' time over trace's whole overhead (traced run
less untraced, plus naming the groups), by the CPU clock, median and quartiles (target <= 10%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import maskcli
from maskcli.trace.demo import Decoder, window_mask

TARGET = 1.5
CHECKS_TARGET = 0.10


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder(vocab=1000, dim=256, heads=4, layers=args.layers).eval()
    ids = torch.randint(1, 1000, (2, args.len))
    ids[1, : args.len // 4] = 0

    def plain() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        generate(model, ids, args.steps, args.window)
        return time.perf_counter() - wall, time.process_time() - cpu

    reports = []  # per traced run: (seconds naming the groups, seconds checking them)

    def traced() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with maskcli.trace() as t:
            generate(model, ids, args.steps, args.window)
        elapsed = time.perf_counter() - wall, time.process_time() - cpu
        assert len(t.calls) == args.layers * (args.steps + 1)
        reports.append(report(t))
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
    shares = [checking / (b[1] - a[1] + naming) for (a, b), (naming, checking) in zip(samples, reports)]
    q1, median, q3 = statistics.quantiles(shares, n=4)
    print(f"checks: median {statistics.median(c for _, c in reports) * 1e3:.2f} ms a run (naming the groups "
          f"{statistics.median(n for n, _ in reports) * 1e3:.1f} ms); checks / trace's overhead median {median:.1%} "
          f"(quartiles {q1:.1%}-{q3:.1%}), target <= {CHECKS_TARGET:.0%}: {'met' if median <= CHECKS_TARGET else 'NOT met'}")


def report(t) -> tuple[float, float]:
    """CPU seconds naming the trace's groups as the report does, and CPU seconds running the checks over them."""
    from maskcli.checks.context import Run
    from maskcli.checks.engine import apply
    from maskcli.trace.report import group

    start = time.process_time()
    groups = group(t.calls)
    named = time.process_time()
    apply(groups, Run(t.calls, t.tops))
    return named - start, time.process_time() - named


if __name__ == "__main__":
    main()
