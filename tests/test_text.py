"""maskcli/text.py: numbers put into words (spans of positions)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from maskcli.text import spans


def _reference(values: list[int]) -> str:
    """Runs of consecutive values, by a loop over them."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@given(st.lists(st.integers(-50, 50), max_size=40))
def test_spans_of_a_list_and_of_an_array_are_the_loops_runs(values):
    assert spans(values) == _reference(values) == spans(np.array(values, dtype=np.int64))


def test_spans_of_sorted_positions():
    assert spans([0, 1, 2, 5]) == "0-2, 5" and spans([]) == "" and spans(np.arange(10**6)) == "0-999999"
