"""--why at 1M tokens: explaining one cell against explaining the same cell of the 8-token mask, and against the
mask's own intervals (what a cell read off the whole mask would cost).

For each expression, the median time of explain() at a cell near the end of a 1,048,576-token mask, the ratio to
the same expression at 8 tokens (1 means the work does not grow with the length), and the ratio of building the
whole mask's intervals to one explain() (how much --why saves). Machines here are shared and noisy: read the ratios.

    python benchmarks/why.py [--runs 50]
"""

from __future__ import annotations

import argparse

from maskcli.mask import MaskOptions, build
from maskcli.why import explain
from timing import timed  # noqa: E402  (benchmarks/timing.py, beside this script)

N = 1 << 20
CASES = [
    # (expression at 1M, its options, the same at 8 tokens, its options, a cell of each)
    ("document(sizes=[600000,448576]) & window(4096)", {"lengths": "1048576,1000000"},
     "document(sizes=[4,4]) & window(2)", {"lengths": "8,6"}, (1040000, 1039000), (7, 5)),
    ("causal & (window(1020) | sink(4)) & ~tril(-5)", {"length": N},
     "causal & (window(2) | sink(1)) & ~tril(-5)", {"length": 8}, (N - 1, 2), (7, 0)),
    ("local(8192)", {"length": N}, "local(2)", {"length": 8}, (N - 1, N - 5000), (7, 5)),
    # local restarts its chunks at each document: it reads its labels back to the document's start
    ("document(sizes=[600000,448576]) & local(8192)", {}, "document(sizes=[4,4]) & local(2)", {}, (1040000, 1039000), (7, 6)),
]



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    runs = parser.parse_args().runs
    print(f"{'expression at 1M tokens':56} {'explain':>10} {'vs 8 tokens':>12} {'intervals / explain':>20}")
    for long, long_options, short, short_options, cell, small_cell in CASES:
        big, small = build(long, MaskOptions(**long_options)), build(short, MaskOptions(**short_options))
        explain(big, 0, *cell), explain(small, 0, *small_cell)  # labels made once, as a view would have them
        at_length = timed(lambda: explain(big, 0, *cell), runs)
        at_eight = timed(lambda: explain(small, 0, *small_cell), runs)
        whole = timed(lambda: build(long, MaskOptions(**long_options)).intervals(), 3)
        print(f"{long[:56]:56} {at_length * 1e6:8.0f}us {at_length / at_eight:11.1f}x {whole / at_length:19.0f}x")


if __name__ == "__main__":
    main()
