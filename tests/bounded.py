"""A bound on what a call may build, in bytes rather than seconds.

A wall-clock bound fails on a shared, busy CI machine whatever the code does (stop 91: three refusals that take 0.1 s
took 11.5 s there). What a size guard protects against is building the cells, so that is what these bounds measure:
the peak of Python's and numpy's allocations while the block runs, as tracemalloc traces them. torch's allocator is
not traced, so a block bounded this way must build its cells in numpy or not at all. A loop that never ends is left to
the suite's own timeouts.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

MIB = 1 << 20


@contextmanager
def builds_under(limit: int) -> Iterator[None]:
    """Assert that the block's peak traced allocation stays under ``limit`` bytes."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
    assert peak < limit, f"the block built {peak / MIB:.1f} MiB at its peak, over the {limit / MIB:.0f} MiB bound"
