"""A real token of a packed document whose query sees no key at all: the document mask dropped one of its own tokens.

The model call's position_ids that restart at 0 inside a row state its packed documents (arguments.py's documents-leak
reads the same restarts); each token of a document counts on from the one before it. A token that counts on (or is
counted on from: a document's first token, followed by position 1) is a real token of a document, not a pad (a
collator pads position_ids with zeros or repeats). Its query sees at least itself under any mask a document holds
(causal, a window, chunks), so a real document token whose row sees no key at all was cut out of its own document by
the mask, and its kernel then gives it no attention the program meant: uniform weights over every key under a finite
fill (other documents' included), NaN under -inf, 0 from SDPA (evabyte#10: `prepare_eva_training_mask` restarted
each later document at `token_idx + 1`, so its first token got the separator id and a row of only masked cells).
Read per batch row on square self-attention calls from position 0 whose keys are the position_ids' tokens; a token
the attention_mask calls padding is not judged, nor a row whose every token sees nothing (fully-masked says it), nor a
document whose every token sees no key and is seen by no query: the mask itself calls all of it padding (LLaMA-Factory's
`prepare_4d_attention_mask`, document index 0, over trailing pads whose position_ids count 0, 1, 2).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.arguments import document_starts
from maskcli.checks.context import Run, cross, keep, queries
from maskcli.checks.registry import Rule
from maskcli.checks.kernelrows import what_api_does
from maskcli.text import Finding, spans


def counted(positions: np.ndarray) -> np.ndarray:
    """Bool (B, L): tokens of a run that counts up by 1 (this one follows its left neighbour, or its right neighbour
    follows it): a document's real tokens, not the zeros or repeats a collator pads with."""
    on = np.zeros(positions.shape, dtype=bool)
    on[:, 1:] = positions[:, 1:] == positions[:, :-1] + 1
    from_ = np.zeros(positions.shape, dtype=bool)
    from_[:, :-1] = on[:, 1:]
    return (on | from_) & (positions >= 0)


def empty_document_rows(run: Run) -> list:
    """A real token of a packed document (position_ids restarting) whose query sees no key at all."""
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        positions = None if top is None else top.arguments.get("position_ids")
        if positions is None or positions.ndim != 2 or call.stored is None or call.shape[2] != call.shape[3] \
                or positions.shape[1] != call.shape[3] or cross(call):
            continue
        real = top.arguments.get("attention_mask")
        real = real if real is not None and real.shape == positions.shape else None
        labels = document_starts(positions, real)
        if not (labels[:, -1] > 0).any() or queries(call, top)[0] != 0:
            continue  # (no restart: one document a row, no packing stated)
        key = (call.mask, call.shape, positions.tobytes())
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        rows = max(call.shape[0], positions.shape[0])
        if cells is None or cells.shape[0] not in (1, rows) or positions.shape[0] not in (1, rows):
            continue
        seen = np.broadcast_to(cells.any(axis=1), (rows, *cells.shape[2:]))  # (rows, L, L) over the heads
        judged = np.broadcast_to(counted(positions), (rows, positions.shape[1]))
        if real is not None:
            judged = judged & np.broadcast_to(real != 0, judged.shape)
        empty = ~seen.any(axis=-1) & judged
        empty &= seen.any(axis=(1, 2))[:, None]  # (a row that sees nothing anywhere: fully-masked's)
        docs = np.broadcast_to(labels, (rows, labels.shape[1]))
        for b in np.flatnonzero(empty.any(axis=1)):  # a document none of whose rows sees a key and none of whose keys
            live = seen[b].any(axis=-1) | seen[b].any(axis=0)  # is seen: the mask calls all of it padding (a collator's
            empty[b] &= np.isin(docs[b], docs[b][live])  # trailing pads at positions 0, 1, 2, LLaMA-Factory's index 0)
        if not empty.any():
            continue
        b = int(np.flatnonzero(empty.any(axis=1))[0])
        rows_b = np.flatnonzero(empty[b]).tolist()
        q = rows_b[0]
        doc = docs[b]
        own = np.flatnonzero((doc == doc[q]) & judged[b])
        unseen = not seen[b][own][:, q].any()
        found.append((call, Finding("document-row-empty", (
            f"batch row {b}: token {q}, at position {int(np.broadcast_to(positions, (rows, positions.shape[1]))[b, q])} "
            f"of the packed document at tokens {spans(own.tolist())} (position_ids restarting), sees no key at all, "
            f"not even its own{', and no query of its document sees it' if unseen else ''}: {what_api_does(call)} "
            f"({len(rows_b)} such row{'s' if len(rows_b) > 1 else ''} in batch row {b}): the document mask cut it out "
            f"of its own document"),
            expected="each real token of a document sees at least itself",
            source=f"position_ids of {top.where}", cell=(b, q, q))))
    return found


RULES = (
    Rule("document-row-empty", "wrong", "steps", "a real token of a packed document (position_ids restarting at 0) "
         "whose query sees no key at all: the document mask cut it out of its own document", empty_document_rows),
)
