"""checks/heldkeys.py: a key mask expanded over the cells read as the batch's padding (only one way round of it is a
padded batch), and the memory's padding left out of a self-attention's readings (test_checks_held.py runs the
programs)."""

from __future__ import annotations

import numpy as np

from maskcli.checks.held import readings
from maskcli.checks.heldkeys import _as_keys


def _expanded(real: list[list[int]], true_is_padding: bool) -> np.ndarray:
    """(B, L, L) cells: query q of row b may see key k, by a loop over the cells."""
    rows, length = len(real), len(real[0])
    out = np.zeros((rows, length, length), dtype=bool)
    for b in range(rows):
        for q in range(length):
            for k in range(length):
                out[b, q, k] = (not real[b][k]) if true_is_padding else bool(real[b][k])
    return out


def test_either_way_round_the_padded_batch_is_found():
    real = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    for true_is_padding in (True, False):
        held = {"kind": "cells", "rows": _expanded(real, true_is_padding), "name": "mask", "where": "f()"}
        read = _as_keys(held, (), 4, readings)
        assert read["kind"] == ("pad" if true_is_padding else "keep")
        keys = read["rows"] if read["kind"] == "keep" else ~read["rows"]
        assert keys.tolist() == [[bool(x) for x in row] for row in real]


def test_cells_that_are_not_one_key_row_are_left_alone():
    real = [[1, 1, 1, 1], [1, 1, 0, 0]]
    causal = _expanded(real, False) & np.tril(np.ones((4, 4), dtype=bool))  # (query rows differ: not a key mask)
    assert _as_keys({"kind": "cells", "rows": causal, "name": "mask", "where": "f()"}, (), 4, readings) is None
    every_row_padded = [[1, 1, 1, 0], [1, 1, 0, 0]]  # (no row whole: either way round may be meant)
    held = {"kind": "cells", "rows": _expanded(every_row_padded, True), "name": "mask", "where": "f()"}
    assert _as_keys(held, (), 4, readings) is None
    held = {"kind": "cells", "rows": _expanded(real, True), "name": "mask", "where": "f()"}
    assert _as_keys(held, (), 5, readings) is None  # (not this call's keys)
