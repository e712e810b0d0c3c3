"""checks/heldpad.py: the padding of ids held in a batch dict, placed on an attention's keys every way they fit."""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Top
from maskcli.checks.heldpad import held_readings


def _top(ids, pad_id=0):
    return Top("Model", None, {"held_ids": ('x["seq"]', np.asarray(ids), pad_id)}, 0, 1)


def test_each_placement_of_the_ids_among_the_keys_is_one_reading():
    ids = [[5, 6, 7, 8], [5, 6, 0, 0]]
    readings, source, sure, words = held_readings(_top(ids), 2, 5)
    # the reference: the ids' tokens at keys s .. s + 3, every other key real, by a plain loop
    for start, real in zip((0, 1), readings):
        for b in range(2):
            for k in range(5):
                inside = start <= k < start + 4
                assert real[b, k] == (not inside or ids[b][k - start] != 0)
    assert len(readings) == 2 and sure and "pad id 0" in source and "keys 0-3 or as keys 1-4" in words


def test_as_many_keys_as_ids_is_one_reading_with_no_words():
    readings, _, _, words = held_readings(_top([[5, 6, 7], [5, 0, 0]]), 2, 3)
    assert len(readings) == 1 and words == ""
    assert readings[0].tolist() == [[True, True, True], [True, False, False]]


def test_nothing_where_the_ids_are_no_padded_batch_or_the_keys_are_far_more():
    assert held_readings(_top([[0, 6, 0], [5, 0, 7]]), 2, 3) is None  # pad ids not at one end
    assert held_readings(_top([[5, 0, 0], [5, 6, 0]]), 2, 3) is None  # no row unpadded
    assert held_readings(_top([[5, 6, 7], [5, 0, 0]]), 2, 9) is None  # keys the ids do not place
    assert held_readings(_top([[5, 6, 7], [5, 0, 0]]), 3, 3) is None  # another batch
    assert held_readings(Top("Model", None, {}, 0, 1), 2, 3) is None
