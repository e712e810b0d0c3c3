"""checks/ringed.py: the calls of a site whose keys stopped growing after they grew (a ring or evicting cache)."""

from __future__ import annotations

from types import SimpleNamespace

from maskcli.checks.context import Run
from maskcli.checks.ringed import rolled


def _run(shapes: list[tuple[int, int]]) -> Run:
    calls = [SimpleNamespace(index=i, where="layers.0.attn", step=i, shape=(2, 4, q, k), details={}, api="softmax",
                             stored={}, mask=i)
             for i, (q, k) in enumerate(shapes)]
    return Run(calls)


def _reference(shapes: list[tuple[int, int]]) -> set:
    """A plain reading: step i is rolled where, since the latest pass before it (q == k; else the first call), some
    step j <= i holds no more keys than the call before it, and the keys grew at some step before j."""
    found = set()
    for i, (q, k) in enumerate(shapes):
        if q == k:
            continue
        start = max([j for j in range(i) if shapes[j][0] == shapes[j][1]], default=0)
        keys = [shape[1] for shape in shapes[start:i + 1]]
        if any(keys[j] <= keys[j - 1] and any(keys[m] > keys[m - 1] for m in range(1, j)) for j in range(1, len(keys))):
            found.add(i)
    return found


def test_a_ring_that_fills_and_wraps_and_a_static_cache():
    """mlx-lm's rotating cache (quiet-r141b): a pass of 2, steps to 5 keys, then 5 keys a step: rolled from the first
    step that did not grow. A static cache (as many keys at every step) and a growing one never roll; a new pass
    starts over."""
    ring = [(2, 2), (1, 3), (1, 4), (1, 5), (1, 5), (1, 5)]
    assert rolled(_run(ring)) == {4, 5} == _reference(ring)
    static = [(3, 8), (1, 8), (1, 8)]
    assert rolled(_run(static)) == set() == _reference(static)
    growing = [(3, 3), (1, 4), (1, 5), (1, 6)]
    assert rolled(_run(growing)) == set() == _reference(growing)
    again = ring + [(3, 3), (1, 4)]
    assert rolled(_run(again)) == {4, 5} == _reference(again)
    trimmed = [(4, 4), (4, 8), (1, 5), (1, 5)]  # (a chunk behind the window, then the cache cut back to it)
    assert rolled(_run(trimmed)) == {2, 3} == _reference(trimmed)
