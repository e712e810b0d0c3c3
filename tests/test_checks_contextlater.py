"""checks/contextlater.py (and trace/held.py's positions that go down without restarting): a query that sees a context
key at a later position than its own, caught in the published bug's reproduction (tests/data/bugs) and in a program
written another way (tests/data/contextlater), quiet on both fixes; the flagged cells against a double loop."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.checks import contextlater
from maskcli.trace.held import _as_padding, split_top

CONTEXTLATER = Path(__file__).parent / "data" / "contextlater"


def test_specforge_dflash_random_anchor_context_by_block_id_is_found(tmp_path):
    # sgl-project/SpecForge 41e252e: ctx_mask = k_ids < q_ids over sampled, overlapping anchor blocks; the fix compares
    # the key's original position with the query block's anchor (k_orig < q_anchor)
    found = check_bug(tmp_path, "specforge_dflash_random_anchor_context_mask_by_block_id", "context-seen-later")
    assert len(found) == 1
    assert "by position_ids" in found[0]["message"]


def test_parallel_draft_spans_context_by_span_index_is_found(tmp_path):
    found = check_bug(tmp_path, "parallel_draft_overlapping_spans_context_by_span_index", "context-seen-later",
                      folder=CONTEXTLATER)
    # anchors 1, 2: span 1's first query (position 2, query 3) sees span 0's context token at position 3 (key 2)
    assert tuple(found[0]["cell"]) == (0, 3, 2)


def test_judged_against_a_double_loop(monkeypatch):
    monkeypatch.setattr(contextlater, "keep", lambda call: call.stored)
    anchors, span = [1, 2, 4, 9], 3
    pos = np.array([a + o for a in anchors for o in range(span)])
    n = len(pos)
    positions = np.concatenate([pos, pos])[None]
    held = {"name": "positions", "where": "f()", "rows": positions}
    for by_index in (True, False):
        cells = np.zeros((1, 1, n, 2 * n), dtype=bool)
        for i in range(n):
            for j in range(n):
                cells[0, 0, i, j] = j // span < i // span if by_index else pos[j] < anchors[i // span]
                cells[0, 0, i, n + j] = j // span == i // span
        call = SimpleNamespace(stored=cells, shape=cells.shape)
        found = contextlater._judged(call, held)
        later = sum(1 for i in range(n) for j in range(n) if cells[0, 0, i, j] and pos[j] > pos[i])
        assert (found is None) == (later == 0)
        if found is not None:
            assert f"({later} such cells)" in found.message


def test_positions_that_go_down_are_held_apart_from_the_padding():
    gathered = torch.tensor([[3, 4, 5, 4, 5, 6, 3, 4, 5, 4, 5, 6]])
    read = {**_as_padding("position_ids", gathered), "name": "position_ids", "where": "f()"}
    assert read["kind"] == "drops"
    restarting = _as_padding("position_ids", torch.tensor([[0, 1, 2, 0, 1]]))
    assert restarting["kind"] == "positions"  # packed documents: still the padding's (held.py's documents)
    assert _as_padding("position_ids", torch.arange(6)[None]) is None  # counting up: nothing to say
    details = {"held_padding": [read, {**restarting, "name": "p", "where": "g()"}]}
    split_top(details)
    assert details["held_positions"] == [read] and [h["kind"] for h in details["held_padding"]] == ["positions"]
