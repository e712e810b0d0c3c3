"""checks/packing.py: a packed batch's rules on small batches, each against a loop over the tokens written here
(pack's whole report is test_pack.py's)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from maskcli.checks.packing import IGNORE, labels, lengths, rope


def documents(starts: list[list[int]]):
    """The reference field: a document starts at each listed position of each row."""
    found = np.zeros((len(starts), 6), dtype=bool)
    for row, positions in enumerate(starts):
        found[row, positions] = True
    return SimpleNamespace(name="cu_seq_lens_q", starts=found)


def test_position_ids_that_count_on_at_a_document_start_are_flagged_at_each_such_start():
    ref = documents([[0, 3], [0, 2, 4]])
    positions = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3]])  # row 0 never restarts; row 1 restarts at 2, not 4
    pad = np.zeros((2, 6), dtype=bool)
    on = [(r, c) for r in range(2) for c in range(1, 6) if ref.starts[r, c] and positions[r, c] == positions[r, c - 1] + 1]
    assert on == [(0, 3), (1, 4)]
    [found] = rope(SimpleNamespace(fields={"position_ids": positions}), ref, pad)
    assert found.message.startswith("position_ids do not restart at 2 of cu_seq_lens_q's document starts")
    assert "row 0 position 3 (position_id 3), row 1 position 4 (position_id 2)" in found.message
    restarting = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 0, 1]])
    assert rope(SimpleNamespace(fields={"position_ids": restarting}), ref, pad) == []


def test_labels_that_predict_across_some_boundaries_and_labels_on_padding():
    ref = documents([[0, 3]])
    ids = np.array([[5, 6, 7, 8, 9, 0]])
    pad = np.array([[False] * 5 + [True]])
    given = np.array([[5, 6, 7, IGNORE, 9, 0]])  # unshifted, -100 at the one start: right; padding labelled: wrong
    found, notes = labels(SimpleNamespace(fields={"labels": given, "input_ids": ids}), ref, pad)
    assert [f.code for f in found] == ["labels-on-padding"] and notes == []
    given = np.array([[5, 6, 7, 8, 9, IGNORE]])  # -100 at no start: a note (DataCollatorWithFlattening's way), not wrong
    found, notes = labels(SimpleNamespace(fields={"labels": given, "input_ids": ids}), ref, pad)
    assert found == [] and notes[0].startswith("labels are never -100 at the first token of each document")


def test_cu_seqlens_that_do_not_add_up_and_a_max_length_below_the_longest_document():
    cu = np.array([0, 3, 5])
    batch = SimpleNamespace(tokens=6, fields={"cu_seq_lens_q": cu, "cu_seq_lens_k": np.array([0, 3, 6]), "max_length_q": np.array([2])})
    found, _ = lengths(batch, np.zeros((1, 6), dtype=bool))
    assert int(np.diff(cu).max()) == 3 and cu[-1] != 6  # independent: the longest document and the sum
    assert [f.code for f in found] == ["lengths-sum", "q-k-differ", "max-length"]
