"""Naming a mask tensor's structure in process: what `show --mask FILE` and `inspect FILE` spend on recognition.

    PYTHONPATH=. python benchmarks/naming.py [--runs 15] [--len 512] [--cpu]

For each mask (a window, StreamingLLM's sinks beside a window, chunked attention, packed documents, a random one
that no kind rebuilds, and the window over 4x the length), the median time of polarity's two readings (each
reading's candidates named: what `show --mask` asks) and of inspect's whole analysis (with the closest kind where
nothing rebuilds it). Medians of interleaved runs: the machines here are shared and noisy. `--cpu` times the process's
CPU (time.process_time), not the wall clock: on a machine whose cores other work shares, the wall clock mostly
measures the wait for a core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def masks(length: int) -> dict[str, np.ndarray]:
    q, k = np.arange(length)[:, None], np.arange(length)[None, :]
    documents = np.repeat(np.arange(4), np.diff(np.linspace(0, length, 5).astype(int)))
    big = 4 * length
    qb, kb = np.arange(big)[:, None], np.arange(big)[None, :]
    return {
        "window(128)": (k <= q) & (k > q - 128),
        "causal & (window(64) | sink(4))": (k <= q) & ((k > q - 64) | (k < 4)),
        "local(64)": (k <= q) & (q // 64 == k // 64),
        "document & causal": (k <= q) & (documents[:, None] == documents[None, :]),
        "random (no kind)": np.random.default_rng(0).random((length // 4, length // 4)) < 0.5,
        f"window(128) at {big}": (kb <= qb) & (kb > qb - 128),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--len", type=int, default=512, dest="length")
    parser.add_argument("--cpu", action="store_true", help="time the process's CPU, not the wall clock")
    args = parser.parse_args()
    from maskcli.inspect.analysis import analyse
    from maskcli.inspect.structure import readings

    cases = masks(args.length)
    work = {}
    for name, keep in cases.items():
        work[f"readings  {name}"] = lambda keep=keep: readings(keep[None, None])
        work[f"inspect   {name}"] = lambda keep=keep: analyse(keep)
    for run in work.values():  # warm: imports, caches
        run()
    clock = time.process_time if args.cpu else time.perf_counter
    times: dict[str, list[float]] = {label: [] for label in work}
    for _ in range(args.runs):
        for label, run in work.items():
            start = clock()
            run()
            times[label].append(clock() - start)
    print(f"masks of {args.length} x {args.length} (the last 4x), medians of {args.runs} runs ({'CPU' if args.cpu else 'wall'})")
    for label, values in times.items():
        print(f"{label:48s} {statistics.median(values) * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
