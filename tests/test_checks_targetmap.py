"""checks/targetmap.py (and trace/targetmap.py, which keeps the model call's target_mapping): a query-stream predict
placed in one batch row and not in another."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug
from maskcli.checks.targetmap import unplaced

TARGETMAP = Path(__file__).parent / "data" / "targetmap"


def test_xlnet_generate_target_mapping_first_row_only(tmp_path):
    """huggingface/transformers#7267 (written blind, batch blind-dd): prepare_inputs_for_generation set
    `target_mapping[0, 0, -1] = 1.0`; the fix sets `[:, 0, -1]`. Prompts of 6 tokens and a dummy: rows 1 and 2 of the
    first step's predict 0 stand for nothing, row 0's for position 6."""
    hit = check_bug(tmp_path, "transformers_xlnet_generate_target_mapping_first_row_only", "query-unplaced")[0]
    assert tuple(hit["cell"]) == (1, 0, 6)


def test_plm_eval_targets_placed_for_first_row(tmp_path):
    """Written another way: two predicts per left-padded row, labels given, the mapping filled for row 0's targets."""
    [hit] = check_bug(tmp_path, "plm_eval_targets_placed_for_first_row", "query-unplaced", folder=TARGETMAP)
    mapping = np.zeros((3, 2, 10), bool)
    mapping[0, 0, 8] = mapping[0, 1, 9] = True
    empty = [(b, i) for b in range(3) for i in range(2) if not mapping[b, i].any() and mapping[:, i].any()]
    assert tuple(hit["cell"]) == (*empty[0], 8)
    assert f"({len(empty)} such predicts)" in hit["message"].replace("\n", " ")


def _run(mapping, labels=None):
    top = SimpleNamespace(arguments={"target_mapping": mapping, **({} if labels is None else {"target_labels": labels})},
                          where="Model")
    call = SimpleNamespace(shape=(mapping.shape[0], 1, 4, 4))
    return SimpleNamespace(tops=[top], calls=[call], top=lambda c: top)


def test_quiet_on_padded_predicts_and_on_every_row_placed():
    """Predicts the loss ignores (XLNet's padded predictions, labels -100) and a mapping placed in every row: quiet;
    the same mapping with those labels counted is found."""
    mapping = np.zeros((2, 2, 4), bool)
    mapping[0, 0, 2] = mapping[0, 1, 3] = mapping[1, 0, 3] = True  # row 1 predicts one token, its second is padding
    assert unplaced(_run(mapping, np.array([[7, 8], [9, -100]]))) == []
    assert unplaced(_run(np.eye(4, dtype=bool)[None].repeat(2, 0))) == []
    [(_, finding)] = unplaced(_run(mapping, np.array([[7, 8], [9, 10]])))
    assert finding.cell == (1, 1, 3)
