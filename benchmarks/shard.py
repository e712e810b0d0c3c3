"""`maskcli shard` at its target size: 1M tokens, 8 documents, window(4096), 64 ranks, every layout.

Each layout is analysed end to end in process as `maskcli shard EXPR --layout L --ranks 64` does (the layout,
every rank's cells, the ring-step grid, cu_seqlens, the checks). The reference, measured in the same run: the
mask's exact visible cells from its intervals (build, intervals, counts().sum()), the least any exact split
must do. Budget per layout: 2 s and 500 MB (peak numpy memory, by tracemalloc, over the analysis). Machines
here are shared and noisy: read the ratios (medians), not one time.

    python benchmarks/shard.py [--runs 3] [--length 1048576] [--ranks 64]
"""

from __future__ import annotations

import argparse
import tracemalloc

from maskcli.mask import build
from maskcli.shard.plan import analyse
from timing import timed  # noqa: E402  (benchmarks/timing.py, beside this script)

LAYOUTS = ("contiguous", "headtail", "per-document", "striped", "striped:128", "ulysses", "ptrr")
BUDGET_S, BUDGET_MB = 2.0, 500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--length", type=int, default=1 << 20)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    sizes = [args.length // 8] * 7 + [args.length - 7 * (args.length // 8)]
    expr = f"document(sizes=[{','.join(map(str, sizes))}]) & window(4096)"

    def reference():
        return int(build(expr, heads=args.ranks).intervals().counts().sum())

    base = timed(reference, args.runs)
    print(f"{args.length:,} tokens, 8 documents, window(4096), {args.ranks} ranks; reference (build + exact cells) {base:.3f} s")
    print(f"{'layout':<14}{'median s':>10}{'x reference':>13}{'peak MB':>10}{'imbalance':>11}  budget")
    for layout in LAYOUTS:
        def run(layout=layout):
            return analyse([("mask", build(expr, heads=args.ranks))], layout, args.ranks)

        seconds = timed(run, args.runs)
        tracemalloc.start()
        report = run()
        peak = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        within = "ok" if seconds <= BUDGET_S and peak <= BUDGET_MB else "OVER"
        print(f"{layout:<14}{seconds:>10.3f}{seconds / base:>13.2f}{peak:>10.0f}{report.splits[0][1].imbalance:>11.3f}  {within}")


if __name__ == "__main__":
    main()
