"""Cost of trace's overflow watch (maskcli/trace/overflow.py): the decoder of benchmarks/trace.py traced with the watch
and with it switched off, in the same run, alternating, on the CPU.

    python benchmarks/overflow.py [--runs 15] [--len 128] [--steps 8] [--layers 4]

The watch looks at the result of every cast that narrows a float and every sum, difference and product of the
program (a -inf made of finite values), so it costs a pass over those results. It prints the median CPU time of each
side and the median of the paired ratios (watched / unwatched) with quartiles, and the same ratio against the
untraced run (target: the watch keeps trace within benchmarks/trace.py's 1.5x).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

import maskcli
from maskcli.trace.demo import Decoder
from maskcli.trace.overflow import Overflows


def _generate():
    """benchmarks/trace.py's decoder loop (loaded by path: its module name is the standard library's `trace`)."""
    spec = importlib.util.spec_from_file_location("trace_benchmark", Path(__file__).resolve().parent / "trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Decoder(vocab=1000, dim=256, heads=4, layers=args.layers).eval()
    ids = torch.randint(1, 1000, (2, args.len))
    ids[1, : args.len // 4] = 0
    wanted, generate = Overflows.wanted, _generate()

    def run(traced: bool, watched: bool) -> float:
        Overflows.wanted = wanted if watched else (lambda self, func: False)
        start = time.process_time()
        if traced:
            with maskcli.trace():
                generate(model, ids, args.steps, args.window)
        else:
            generate(model, ids, args.steps, args.window)
        return time.process_time() - start

    run(False, True), run(True, True)  # warm-up
    samples = [(run(False, True), run(True, False), run(True, True)) for _ in range(args.runs)]
    Overflows.wanted = wanted
    plain, off, on = (statistics.median(s[i] for s in samples) for i in range(3))
    ratios = [c / b for _, b, c in samples]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    print(f"cpu medians: untraced {plain * 1e3:.1f} ms, traced without the watch {off * 1e3:.1f} ms, with it {on * 1e3:.1f} ms")
    print(f"watched / unwatched median {median:.3f}x (quartiles {q1:.3f}-{q3:.3f}); traced with the watch / untraced "
          f"median {statistics.median(c / a for a, _, c in samples):.2f}x")


if __name__ == "__main__":
    main()
