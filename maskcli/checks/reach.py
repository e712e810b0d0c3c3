"""A model that states itself causal whose query reads, through a key it sees, a later token it is masked from.

A causal language model's query may see only what came before it; where the model packs other slots beside its
tokens (recurrent memory slots, summary tokens) and builds its own mask, each slot's row says what that slot reads
at one layer, and the next layer's key at that slot carries it. So a query that sees a key whose own row sees a later
key the query itself is masked from reads that later token one layer on: the future leaks through the slot
(recurrent-memory-transformer-pytorch cdff28a: `F.pad(tril, (read, mem) * 2, value=True)` let every token see the
write memories, which see the whole segment). Read where the outermost module states `causal=True` / `is_causal=True`
(trace/stated.py's `model_causal`) and two or more self-attention calls of the model call share the mask (a layer
on another). Quiet on a triangle (no row sees later), a bidirectional block or prefix (a query of it sees it whole),
and slots every token is masked from.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, cross, first_cell, keep, one_run_a_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


MOST = 1 << 27  # multiply-adds one call's reach may cost (rows * L * L * keys through which a later one is read)


def leaks(cells: np.ndarray) -> np.ndarray | None:
    """Bool (rows, L, L): cells (q, j), j > q, that q does not see but reaches through one key it sees; None where that
    costs more than MOST. Only keys some earlier query sees, or whose own row sees a later key, can carry one (none
    under a triangle or a window: the common case costs one pass)."""
    rows, length, _ = cells.shape
    later = band(length, length, 1, True)
    through = np.flatnonzero((cells & later[None]).any(axis=(0, 1)) | (cells & later[None]).any(axis=(0, 2)))
    if through.size == 0:
        return np.zeros_like(cells)
    if rows * length * length * through.size > MOST:
        return None
    seen = cells.astype(np.float32)  # (BLAS: an int matmul is a Python-speed loop in numpy)
    reached = np.matmul(seen[:, :, through], seen[:, through, :]) > 0
    return reached & ~cells & later[None]


def _shared(run: Run, top):
    """(call, its kept cells, how many calls share them) once per mask that two or more square self-attention calls
    of the model call share (one layer alone: nothing reads its keys one layer on)."""
    calls = [call for call in run.made_by(top) if call.stored is not None and not cross(call)
             and call.shape[2] == call.shape[3] > 2]
    counts: dict = {}
    for call in calls:
        counts[(call.mask, call.shape)] = counts.get((call.mask, call.shape), 0) + 1
    done = set()
    for call in calls:
        key = (call.mask, call.shape)
        if counts[key] < 2 or key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is not None:
            yield call, cells, counts[key]


def through_slots(run: Run) -> list:
    """Self-attention calls of a model stating causal=True whose queries reach later tokens through a key they see."""
    found = []
    for top in run.tops:
        said = next((one for one in top.stated if one.fields.get("model_causal")), None)
        if said is None:
            continue
        for call, cells, _ in _shared(run, top):
            bad = leaks(cells.any(axis=1))
            if bad is None or not bad.any():
                continue
            b, q, j = first_cell(bad)
            row = cells.any(axis=1)[b]
            k = int(np.flatnonzero(row[q] & row[:, j])[0])
            found.append((call, Finding("causal-leak-through", (
                f"batch row {b}: query {q} is masked from later key {j}, but sees key {k}, whose own row sees key {j}: "
                f"one layer on, key {k} carries token {j} to query {q} ({int(bad.sum())} such cells), while "
                f"{said.source} states the model causal (slots packed beside the tokens that every token may see?)"),
                expected="no query reaches a later key through a key it sees", source=said.source, cell=(b, q, j))))
    return found


def _look_ahead(cells: np.ndarray) -> np.ndarray:
    """Bool (rows, L): queries q that see every key up to their own, are masked from key q + 1 (a look-ahead mask's
    row, whatever else it leaves open) and see a key after that."""
    length = cells.shape[-1]
    at = np.arange(length)
    first_hidden = np.where(cells.all(axis=-1), length, np.argmin(cells, axis=-1))
    last_seen = length - 1 - np.argmax(cells[..., ::-1], axis=-1)
    return (first_hidden == at + 1) & (last_seen > at + 1)


def ahead_leaks(cells: np.ndarray) -> np.ndarray | None:
    """Bool (rows, L, L): cells (q, j), j > q, of look-ahead rows q (_look_ahead) that q does not see but reads through a
    later key k it sees, whose own row sees j; None where that costs more than MOST. A triangle, a window or a prefix
    has no such row: one pass over the cells."""
    rows, length, _ = cells.shape
    ahead = _look_ahead(cells)
    beyond = band(length, length, 2, True)[None] & ahead[:, :, None]  # (rows, q, k): k past a look-ahead row's next key
    seen, unseen = (cells & beyond).any(axis=1), (~cells & beyond).any(axis=1)  # (rows, k): by some such row, or not
    ahead &= ~(seen & unseen).any(axis=1)[:, None]  # (a batch row whose look-ahead rows disagree on a later key is no
    if not ahead.any():  # look-ahead mask with columns opened, padding's: a neighbour set per row, MTR's kNN of tokens)
        return np.zeros_like(cells)
    later = band(length, length, 1, True)
    opened = cells & later[None] & ahead[:, :, None]  # (rows, q, k): later keys a look-ahead row sees
    through = np.flatnonzero(opened.any(axis=(0, 1)))
    if rows * length * length * through.size > MOST:
        return None
    reached = np.matmul(opened[:, :, through].astype(np.float32), cells[:, through, :].astype(np.float32)) > 0
    return reached & ~cells & later[None]


def look_ahead_open(run: Run) -> list:
    """Self-attention calls, two or more of one model call sharing the mask, whose look-ahead rows read later tokens
    through later keys they see."""
    found = []
    for top in run.tops:
        for call, cells, sharing in _shared(run, top):
            if one_run_a_row(call.stored) and call.stored["planes"][1] == 1:
                continue  # (a row of one run of keys masks no key before another it sees: no look-ahead row; heads that
                # differ may keep two runs between them, read over the heads below)
            cells = cells.any(axis=1)
            bad = ahead_leaks(cells)
            if bad is None or not bad.any():
                continue
            b, q, j = first_cell(bad)
            k = int(np.flatnonzero(cells[b, q] & cells[b, :, j] & (np.arange(cells.shape[-1]) > q))[0])
            open_keys = np.flatnonzero(cells[b, q, q + 1:]) + q + 1
            found.append((call, Finding("look-ahead-open", (
                f"batch row {b}: query {q} sees every key up to its own and is masked from key {q + 1} (a look-ahead "
                f"mask), yet sees later keys {spans(open_keys.tolist())}; key {k}'s own row sees key {j}, so one layer "
                f"on ({sharing} calls share this mask) query {q} reads token {j} it is masked from "
                f"({int(bad.sum())} such cells): keys the look-ahead leaves open (a padding mask combined with it the wrong way round?)"),
                expected="no query reads a later key through a later key it sees", cell=(b, q, j))))
    return found


RULES = (
    Rule("causal-leak-through", "wrong", "steps", "a model that states itself causal whose query sees a key whose own "
         "row sees a later key the query is masked from (the future read one layer on, through packed slots)",
         through_slots),
    Rule("look-ahead-open", "wrong", "steps", "a query of a look-ahead mask (every key up to its own, not the next) that "
         "sees a later key whose own row sees a later key the query is masked from, two or more layers sharing the mask",
         look_ahead_open),
)
