"""checks/idspositions.py: left padding the ids and position_ids state together (a run of one id, positions put)."""

from __future__ import annotations

import numpy as np

from maskcli.checks.idspositions import positions_padding


def _batch(lengths, width, pad, fill):
    """Left-padded ids (varied, never `pad`) and positions (`fill` over the pads, 0, 1, ... over the tokens), and the
    real tokens, written out one cell at a time."""
    ids, positions, real = [], [], []
    for row, n in enumerate(lengths):
        ids.append([pad if i < width - n else 10 + 3 * row + i for i in range(width)])
        positions.append([fill if i < width - n else i - (width - n) for i in range(width)])
        real.append([i >= width - n for i in range(width)])
    return np.array(ids), np.array(positions), np.array(real)


def test_a_run_of_one_id_where_the_positions_stay_put_is_padding():
    for fill in (0, 1):  # (fms fills the pads' positions with 0; Hugging Face's cumsum - 1 with 1)
        ids, positions, real = _batch([3, 7, 5], 7, pad=4, fill=fill)
        said = positions_padding(ids, positions)
        assert said is not None and said[1] == 4
        assert (said[0] == real).all()


def test_packed_documents_and_counting_repeats_are_not_padding():
    ids, positions, _ = _batch([3, 7], 7, pad=4, fill=0)
    counted = positions.copy()
    counted[0] = np.arange(7)  # the repeated id counted on: text
    assert positions_padding(ids, counted) is None
    packed = np.array([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    assert positions_padding(packed, np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4]])) is None
    assert positions_padding(ids, None) is None
    unpadded = _batch([7, 7], 7, pad=4, fill=0)
    assert positions_padding(unpadded[0], unpadded[1]) is None
    again = ids.copy()
    again[1, 5] = 4  # the pad id among another row's tokens: not the pad
    assert positions_padding(again, positions) is None
