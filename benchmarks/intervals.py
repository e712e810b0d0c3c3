"""Building exact key intervals of 1M-token masks, against the same intervals written by hand in numpy.

For each expression at 1,048,576 tokens: the median wall time of building it from its text
(parse, bind, intervals) over several runs, its peak traced memory, and the ratio to a
hand-written numpy closed form of the same intervals measured in the same run (where one
is easy to write). Machines here are shared and noisy: read the ratios, not one time.

    python benchmarks/intervals.py [--runs 5]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from maskcli.mask import build
from timing import timed  # noqa: E402  (benchmarks/timing.py, beside this script)

N = 1 << 20
W = 4096
SIZES = ",".join(["4096"] * 256)


def by_hand_document_window():
    q = np.arange(N)
    start = (q // 4096) * 4096
    return np.maximum(start, q - W + 1), q + 1


def by_hand_window():
    q = np.arange(N)
    return np.maximum(0, q - 127), q + 1


def by_hand_sinks():
    q = np.arange(N)
    lo = np.maximum(0, q - 1019)
    joined = lo <= 4
    return np.where(joined, 0, lo), q + 1, joined


CASES = [
    (f"document(sizes=[{SIZES}]) & window({W})", {}, by_hand_document_window),
    ("window(128)", {"length": N}, by_hand_window),
    ("causal & (window(1020) | sink(4))", {"length": N}, by_hand_sinks),
    ("causal", {"length": N}, None),
    ("local(8192)", {"length": N}, None),
    (f"causal | blocks(sizes=[{SIZES}])".replace("blocks(sizes", "segment(sizes"), {}, None),
]



def peak(fn) -> int:
    tracemalloc.start()
    fn()
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{N:,} tokens, median of {args.runs} runs")
    for text, options, by_hand in CASES:
        def ours():
            return build(text, **options).intervals()

        ours()  # warm-up: imports, the kind registry
        mine = timed(ours, args.runs)
        memory = peak(ours)
        shown = text if len(text) < 60 else text[:40] + "..." + text[-14:]
        line = f"{shown:62s} {mine:6.3f} s  peak {memory / 2**20:7.1f} MiB"
        if by_hand is not None:
            theirs = timed(by_hand, args.runs)
            line += f"  by hand {theirs:6.3f} s  ratio {mine / theirs:5.1f}"
        print(line)


if __name__ == "__main__":
    main()
