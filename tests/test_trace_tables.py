"""trace/tables.py: F.embedding's reader keeps each table's last lookup and records no call; an empty lookup (no
row read: WhisperSpeech's `special(toks[special_mask] - codes)` where no token is special) is read as nothing, not as
an attention call that could not be read."""

from __future__ import annotations

import torch
import torch.nn as nn

import maskcli


def test_an_empty_lookup_records_no_call_and_a_lookup_keeps_its_indices():
    table = nn.Embedding(4, 3)
    with maskcli.trace() as t:
        table(torch.zeros(0, dtype=torch.long))
        table(torch.zeros(2, 0, dtype=torch.long))
        table(torch.tensor([[1, 2, 3]]))
    assert t.calls == []
    kept = t._local.__dict__.get("tables", {}).get(id(table.weight))
    assert kept is not None and kept.tolist() == [[1, 2, 3]]


def test_a_reader_that_records_no_call_records_none_where_it_fails(monkeypatch):
    """Whatever goes wrong in a reader of what the program states (its tables, its loss) stays there: no attention
    call that could not be read is recorded in its place (trace/follow.py's capture)."""
    import types

    import maskcli.trace.tables as tables

    monkeypatch.setattr(tables, "np", types.SimpleNamespace())  # (its lookup's copy raises AttributeError)
    table = nn.Embedding(4, 3)
    with maskcli.trace() as t:
        table(torch.tensor([[1, 2, 3]]))
    assert t.calls == []
