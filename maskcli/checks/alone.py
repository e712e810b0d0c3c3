"""A packed document whose attention inside it is not the one the same layer gives that document run alone.

The model call's position_ids that restart at 0 inside a row state its packed documents (arguments.py's
documents-leak reads the same restarts). Packing is meant to change nothing inside a document: each document's block
of the packed mask is the mask its tokens get run alone. Where the program runs the same call site on a sequence
alone (a square self-attention from position 0, one document a row, no padding), and the site's mask there is full
(bidirectional: every query sees every key) or causal for that length, that is the program's own statement of how
the layer attends a sequence of that many tokens; a packed document of the same length whose block is the other
one (full where alone is causal, causal where alone is full) contradicts it (nishide-dev/unturtle#44: an A2D
diffusion LM, full when each document runs alone, given the causal packed-block fallback mask on the packed batch,
causal inside each document). Read per batch row and head of
the packed call, its padding (attention_mask 0) left out; a length the site ran alone two ways says nothing, nor a
site that never ran a sequence alone, nor a packed block that is neither full nor causal (a window, a prefix).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.arguments import document_starts
from maskcli.checks.context import Run, band, cross, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans, step_label


def _kind(block: np.ndarray) -> str | None:
    """'full' or 'causal' of a bool (..., n, n) block where every plane is that one, else None."""
    n = block.shape[-1]
    if block.all():
        return "full"
    if (block == band(n, n, 0, False)).all():
        return "causal"
    return None


def _square_from_zero(run: Run, call) -> bool:
    top = run.top(call)
    return call.shape[2] == call.shape[3] and not cross(call) and int(queries(call, top)[0]) == 0


def _alone(run: Run, calls: list) -> dict[int, tuple[str, object]]:
    """Length -> (kind, call) of the site's calls run on sequences alone (no restart, no padding): one kind each."""
    found: dict[int, tuple[str, object]] = {}
    mixed = set()
    for call in calls:
        top = run.top(call)
        if top is None or not _square_from_zero(run, call):
            continue
        positions = top.arguments.get("position_ids")
        if isinstance(positions, np.ndarray) and positions.ndim == 2 and (document_starts(positions, None)[:, -1] > 0).any():
            continue  # (packed itself)
        real = top.arguments.get("attention_mask")
        if isinstance(real, np.ndarray) and (real == 0).any():
            continue  # (padded: its rows are not the sequence alone)
        cells = keep(call)
        kind = None if cells is None else _kind(cells)
        n = call.shape[3]
        if kind is None or n in mixed:
            continue
        if n in found and found[n][0] != kind:
            mixed.add(n)
            del found[n]
        else:
            found.setdefault(n, (kind, call))
    return found


def unlike_alone(run: Run) -> list:
    """A packed document (position_ids restarting) whose block is full where the same site runs that length causal
    alone, or causal where it runs it full."""
    found, done, read = [], set(), {}
    for where, calls in run.sites().items():
        packed = [(call, said) for call in calls if (said := _packed(run, call, read)) is not None]
        if not packed:
            continue  # (no packed call at this site: its calls alone are not read)
        alone = _alone(run, calls)
        if not alone:
            continue
        for call, (positions, real, labels) in packed:
            cells = keep(call)
            key = (where, call.mask, call.shape, positions.tobytes())
            if cells is None or key in done:
                continue
            done.add(key)
            rows = max(call.shape[0], positions.shape[0])
            if cells.shape[0] not in (1, rows) or positions.shape[0] not in (1, rows):
                continue
            cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
            labels = np.broadcast_to(labels, (rows, labels.shape[1]))
            live = np.ones(labels.shape, dtype=bool) if real is None else np.broadcast_to(real != 0, labels.shape)
            hit = _first(cells, labels, live, alone)
            if hit is None:
                continue
            b, tokens, kind, other, was = hit
            n = len(tokens)
            q, k = _cell(cells[b][:, tokens][:, :, tokens], kind)
            said = "sees every key of it" if kind == "full" else "is causal over it"
            got = "causal inside it" if other == "causal" else "full inside it (every token sees every other)"
            found.append((call, Finding("document-unlike-alone", (
                f"batch row {b}: the packed document at tokens {spans(tokens)} ({n} tokens, position_ids restarting) is "
                f"{got}, while the same layer run on a {n}-token sequence alone ({step_label(was.step, was.shape[2])}) "
                f"{said}: packing changed the attention inside a document"),
                expected=f"each packed document attended as the site attends it alone: {kind}",
                source=f"the calls of {where} on a sequence alone", cell=(b, tokens[q], tokens[k]))))
    return found


def _packed(run: Run, call, read: dict) -> tuple | None:
    """(position_ids, attention_mask or None, document labels) of a square self-attention from position 0 whose model
    call's position_ids restart inside a row; None otherwise (`read`: each model call's, read once)."""
    top = run.top(call)
    positions = None if top is None else top.arguments.get("position_ids")
    if not isinstance(positions, np.ndarray) or positions.ndim != 2 or positions.shape[1] != call.shape[3] \
            or not _square_from_zero(run, call):
        return None
    if id(top) not in read:
        real = top.arguments.get("attention_mask")
        real = real if isinstance(real, np.ndarray) and real.shape == positions.shape else None
        labels = document_starts(positions, real)
        read[id(top)] = (positions, real, labels) if (labels[:, -1] > 0).any() else None
    return read[id(top)]


def _first(cells, labels, live, alone):
    """(row, the document's tokens, the kind alone, the packed block's kind, the call alone) of the first packed
    document whose block is not its length's kind alone; None where every one is."""
    for b in range(labels.shape[0]):
        for doc in np.unique(labels[b]):
            tokens = np.flatnonzero((labels[b] == doc) & live[b])
            if len(tokens) < 2 or len(tokens) not in alone or (np.diff(tokens) != 1).any():
                continue
            kind, was = alone[len(tokens)]
            block = cells[b][:, tokens][:, :, tokens]
            other = _kind(block)
            if other is not None and other != kind:  # (a block neither full nor causal: a window, a prefix, chunks,
                # whatever else the document holds that its run alone did not: not said)
                return b, tokens.tolist(), kind, other, was
    return None


def _cell(block: np.ndarray, kind: str) -> tuple[int, int]:
    """(query, key) in the document of the first cell that differs from `kind` (over the heads)."""
    n = block.shape[-1]
    want = np.ones((n, n), dtype=bool) if kind == "full" else band(n, n, 0, False)
    q, k = np.argwhere((block != want).any(axis=0))[0]
    return int(q), int(k)


RULES = (
    Rule("document-unlike-alone", "wrong", "steps", "a packed document (position_ids restarting) attended causal where "
         "the same layer attends a sequence of its length alone bidirectionally, or the other way round",
         unlike_alone),
)
