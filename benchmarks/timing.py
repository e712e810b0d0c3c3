"""What the benchmarks share: the median wall time of a few runs (shared, noisy machines: never one run)."""

from __future__ import annotations

import statistics
import time


def timed(function, runs: int) -> float:
    """The median seconds of `runs` calls of `function`."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
