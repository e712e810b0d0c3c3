"""A query that sees another packed document's key, the documents' lengths held in the batch dict of a frame.

A trainer that packs documents into one flat row (verl's base_trainer, a multipack collator) keeps each document's
length beside the batch's tensors (`batch["seq_lengths"]`, trace/held.py: details["batch_lengths"]): the row's first
sum(lengths) tokens are those documents in order, each seeing none of another's. Where the call attends one batch row,
the lengths are two or more and the tokens they cover are the call's first keys (its positions, where a frame holds
them or the model call is handed them, count up from 0 over exactly those: the packed tokens laid first, any extra
queries after them, a COD rollout's deeper samples), a query among them that sees a key of another document contradicts
the lengths (verl-SpeCo#18: the document lengths taken from the all-ones attention_mask's sum, so the COD mask saw one
document). Read on square self-attention calls over the heads; what the extra tokens past the documents see is the
mask's own.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.eachheld import first_findings
from maskcli.text import Finding


def _positions(run: Run, call) -> np.ndarray | None:
    """(Lk,) the keys' positions the frames hold (held_positions) or the model call is handed, one row; else None."""
    held = call.details.get("held_positions") or ()
    top = run.top(call)
    given = [h["rows"] for h in held] + [(top.arguments if top is not None else {}).get("position_ids")]
    return next((np.asarray(p)[0] for p in given if isinstance(p, np.ndarray) and p.ndim == 2 and p.shape[0] == 1
                 and p.shape[1] == call.shape[3]), None)


def by_lengths(run: Run) -> list:
    """Calls whose packed documents, by the lengths a batch dict holds, see each other's keys."""
    return first_findings(run, "batch_lengths", lambda call: call.shape[0] == 1 and call.shape[2] == call.shape[3],
                          lambda call, held: _judged(call, np.asarray(held["rows"]), held, _positions(run, call)))


def _judged(call, lengths: np.ndarray, held: dict, positions: np.ndarray | None) -> Finding | None:
    """The finding for `call`'s first sum(lengths) queries and keys against the documents, None where the lengths are
    not two documents or more covering its first keys (`positions`: the keys' held or handed ones), or none sees
    another's key."""
    total = int(lengths.sum())
    if lengths.ndim != 1 or len(lengths) < 2 or (lengths < 1).any() or total > call.shape[3]:
        return None
    if positions is None and total != call.shape[3] or positions is not None and \
            not np.array_equal(positions[:total], np.arange(total)):
        return None  # (the lengths do not cover the call's first keys)
    cells = keep(call)
    if cells is None:
        return None
    document = np.repeat(np.arange(len(lengths)), lengths)
    across = cells.any(axis=1)[:1, :total, :total] & (document[:, None] != document[None, :])[None]
    if not across.any():
        return None
    b, q, k = first_cell(across)
    said = f"{held['name']} {lengths.tolist()} in {held['where']}"
    return Finding("held-documents-leak", (
        f"{said} packs {len(lengths)} documents in the row, but query {q} (document {int(document[q])}) sees key {k} "
        f"of document {int(document[k])} ({int(across.sum())} such cells): the mask does not keep to the documents"),
        expected="a document mask from the lengths", source=said, cell=(b, q, k))
