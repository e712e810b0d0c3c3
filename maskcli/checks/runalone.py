"""A stretch of a batch row that the program also runs alone through the same model, attended otherwise in the batch.

Where the program runs its model on a few tokens alone (one row of ids, no padding, each attention site a square
self-attention from position 0) and those ids are a stretch of a row of another call of the same model, bounded there
by the row's edges, its padding (attention_mask 0) or an id the model states it pads or ends a sequence with (pad_id,
eos_id), the run alone is the program's own statement of that stretch: a sequence of its own, each of its tokens real
and seeing what it sees alone. The batch contradicts it where
- its attention_mask calls padding a token of the stretch, which the run alone holds real (alibaba/ROLL#304: eos ==
  pad, so the response mask `ids != pad` hides each response's eos, which the program's reference runs with it);
- a real query of the stretch sees a real key outside it (praxis#38: documents packed between pad ids under a plain
  causal mask: document B run alone sees itself, packed it sees document A).
Inside the stretch nothing is compared: a model run two ways (GritLM's one model, bidirectional to embed and causal to
generate, on the same tokens) attends its keys otherwise by design (document-unlike-alone reads packed documents' kinds).
Read per batch row, on the batch's calls whose sites the run alone has too; a stretch found nowhere in a row or
twice, or with an ordinary token beside it (a prompt the row continues, a context the run alone leaves out), says
nothing, nor a row that is the whole run alone unpadded in a batch of one (the same sequence run twice).
A call handed an attention_mask states each of its rows too, in a batch of several rows or one row handed as
embeddings (their tokens read by trace/embedids.py: the same vectors, the same id; a float 0/1 mask read as the
integer one): where another call of the same model runs the same row, whole, and calls padding tokens the first keeps
real, each of them after every token it keeps (it cuts the sequence short as right padding), that is wrong
(StateTransformer#93: generate hides the trajectory slots that its training forward, the same embeddings with an
all-ones mask, keeps real). Not said of a run of hidden tokens before a kept one (a context masked on purpose, as an
ablation or contrastive decoding hides one), nor of tokens that are the pad id the model states.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.real import TOKENS, by_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _ids(top) -> np.ndarray | None:
    """The call's token ids (B, L); where it was handed embeddings and no ids, one id per token's vector (trace's
    embeds_ids: the same vectors, the same id)."""
    return next((top.arguments[n] for n in (*TOKENS, "token_ids", "embeds_ids") if isinstance(top.arguments.get(n), np.ndarray)
                 and top.arguments[n].ndim == 2), None)


def _mask(top):
    """The model call's attention_mask: its integers, or its floats of 0 and 1 (trace keeps those apart)."""
    real = top.arguments.get("attention_mask")
    return real if real is not None else top.arguments.get("float_attention_mask")


def _real(top, ids: np.ndarray) -> np.ndarray:
    """Bool (B, L): the model call's attention_mask != 0 where it gives one of the ids' shape, else every token."""
    real = _mask(top)
    return real != 0 if isinstance(real, np.ndarray) and real.shape == ids.shape else np.ones(ids.shape, dtype=bool)


def _square(run: Run, top, length: int) -> dict[str, list]:
    """Site -> the model call's square self-attention calls over `length` keys from position 0, in order."""
    found: dict[str, list] = {}
    for call in run.made_by(top):
        if call.stored is None or cross(call) or not call.shape[2] == call.shape[3] == length:
            continue
        _, own, positions = run.placed(call)
        if positions and own.size and int(own[0]) == 0:
            found.setdefault(call.where, []).append(call)
    return found


def _at(row: np.ndarray, stretch: np.ndarray) -> int | None:
    """Where `stretch` occurs in `row`, where it occurs once; else None."""
    if len(stretch) > len(row):
        return None
    hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(row, len(stretch)) == stretch).all(axis=1))
    return int(hits[0]) if len(hits) == 1 else None


def _bounded(row: np.ndarray, real: np.ndarray, i: int, n: int, ends: set) -> bool:
    """The stretch [i, i + n) of a row has on each side the row's edge, padding, or an id the model pads or ends with."""
    before = i == 0 or not real[i - 1] or int(row[i - 1]) in ends
    after = i + n == len(row) or not real[i + n] or int(row[i + n]) in ends
    return before and after


def _rows(cells: np.ndarray | None, rows: int) -> np.ndarray | None:
    return None if cells is None or cells.shape[0] not in (1, rows) else by_row(cells, rows)


def unlike_run_alone(run: Run) -> list:
    """Tokens the program runs alone that the batch's attention_mask calls padding, or whose queries attend otherwise."""
    tops = [(top, ids) for top in run.tops if (ids := _ids(top)) is not None]
    alone = [(top, ids[0]) for top, ids in tops if ids.shape[0] == 1 and ids.shape[1] >= 3 and _real(top, ids).all()]
    if not alone:
        return _rows_twice(run, tops)  # (no model call on one unpadded row: most runs stop here)
    found, squares = [], {}
    for top, ids in tops:
        real = _real(top, ids)
        ends = {v for v in (top.arguments.get("pad_id"), top.arguments.get("eos_id")) if isinstance(v, int)}
        for other, stretch in alone:
            n = len(stretch)
            if other is top or other.where != top.where or ids.shape == (1, n):
                continue
            for b in range(ids.shape[0]):
                i = _at(ids[b], stretch)
                if i is None or not _bounded(ids[b], real[b], i, n, ends):
                    continue
                if id(top) not in squares:
                    squares[id(top)] = _square(run, top, ids.shape[1])
                mine, theirs = squares[id(top)], _square(run, other, n)
                sites = [where for where in mine if where in theirs]
                hidden = np.flatnonzero(~real[b, i:i + n]) + i
                if not sites and len(hidden) and not real[b, :i].any() and not real[b, i + n:].any():
                    found += _lengthened(run, top, other, ids, b, hidden, n)  # (the model lengthens its tokens)
                    break
                pads = _pads(top, ids[b], real[b], i, n) if not sites and not len(hidden) else None
                if pads is not None:
                    found += _pads_attended(run, top, other, ids, b, pads, n)
                    break
                if not sites:
                    continue
                hit = _first(mine, sites, ids.shape[0], i, n, real[b], b)
                said = f"the program runs tokens {spans(list(range(i, i + n)))} of batch row {b} alone ({n} tokens, " \
                       f"another call of {top.where})"
                if len(hidden):
                    k = int(hidden[0])
                    call = mine[sites[0]][0]
                    found.append((call, Finding("unlike-run-alone", (
                        f"{said}, each of them real; but the attention_mask of this call calls {len(hidden)} of them "
                        f"padding (token {k}, {_token(top, ids, b, k)}): a real token of that sequence hidden from the batch"),
                        expected="every token the program runs alone real in the batch",
                        source=f"the attention_mask of {top.where}, against the program's run of those tokens alone",
                        cell=(b, k, k))))
                elif hit is not None:
                    call, q, k = hit
                    found.append((call, Finding("unlike-run-alone", (
                        f"{said}; but in the batch query {q} of that stretch sees key {k} outside it: the stretch is "
                        f"attended otherwise than the program runs it alone (its boundary is lost)"),
                        expected="each real query of the stretch seeing no real key outside it",
                        source="the program's run of those tokens alone", cell=(b, q, k))))
                break  # (one finding a batch call per stretch run alone)
    return found + _rows_twice(run, tops)


def _attended(run: Run, top, rows: int, least: bool = False) -> dict:
    """Site -> the most keys one query of each batch row sees (a padded query that sees only itself, or none, is no
    bound; `least`: the fewest), at the first self-attention of `top` over all its rows (a softmax of a site that masks
    nowhere: every key)."""
    found, unmasked = {}, {id(c) for c in run.unmasked}
    for call in sorted((c for c in (*run.made_by(top), *run.unmasked) if top.first <= c.index < top.end),
                       key=lambda c: c.index):
        if call.where in found or cross(call) or call.shape[0] != rows or call.shape[2] != call.shape[3]:
            continue
        cells = _rows(keep(call), rows) if call.stored is not None else None
        if id(call) in unmasked:
            found[call.where] = (call, np.full(rows, call.shape[3]))
        elif cells is not None:
            seen = cells.sum(axis=2)
            found[call.where] = (call, seen.min(axis=1) if least else seen.max(axis=1))
    return found


def _lengthened(run: Run, top, other, ids: np.ndarray, b: int, hidden: np.ndarray, n: int) -> list:
    """unlike-run-alone where the model lengthens the ids it is handed (an image placeholder into its features), so
    the kernel's keys are no positions of the ids: batch row `b` holds real only the stretch run alone, less the
    `hidden` tokens its attention_mask calls padding, and its keys at a site are fewer than the run alone attends
    there (the same ids, the same lengthening): the hidden tokens were dropped or hidden on the way to the kernel."""
    mine, theirs = _attended(run, top, ids.shape[0]), _attended(run, other, 1)
    for where in (w for w in mine if w in theirs):
        (call, seen), alone = mine[where], int(theirs[where][1][0])
        if int(seen[b]) < alone:
            k = int(hidden[0])
            return [(call, Finding("unlike-run-alone", (
                f"the program runs batch row {b} alone ({n} tokens, another call of {top.where}), each of them real, "
                f"and {where} attends {alone} keys there; but the attention_mask of this call calls {len(hidden)} of "
                f"them padding (token {k}, {_token(top, ids, b, k)}) and the row attends {int(seen[b])} keys at the "
                f"same site: real tokens of that sequence dropped or hidden as padding"),
                expected="every token the program runs alone real in the batch",
                source=f"the attention_mask of {top.where}, against the program's run of those tokens alone"))]
    return []


def _pads(top, row: np.ndarray, real: np.ndarray, i: int, n: int) -> np.ndarray | None:
    """The tokens of a row around its stretch [i, i + n), where each is the pad id the model states (no eos) and the
    call's attention_mask, if any, keeps the whole row; None where there are none or any other token."""
    pad = top.arguments.get("pad_id")
    if not isinstance(pad, int) or pad == top.arguments.get("eos_id") or not real.all():
        return None
    rest = np.r_[0:i, i + n:len(row)]
    return rest if len(rest) and (row[rest] == pad).all() else None


def _pads_attended(run: Run, top, other, ids: np.ndarray, b: int, pads: np.ndarray, n: int) -> list:
    """unlike-run-alone where the model lengthens its ids (image features put before the text) and batch row `b` is
    the stretch run alone and the pad id: at a site both calls reach, each query of the row (its fewest-seeing one)
    attends exactly its pad tokens more keys than any query alone attends there (the same ids, the same lengthening),
    so its real queries attend the padding, wherever the lengthening puts them (a causal row, right padded, is quiet:
    its first query sees one key)."""
    mine, theirs = _attended(run, top, ids.shape[0], least=True), _attended(run, other, 1)
    for where in (w for w in mine if w in theirs):
        (call, seen), alone = mine[where], int(theirs[where][1][0])
        if int(seen[b]) == alone + len(pads):
            return [(call, Finding("unlike-run-alone", (
                f"the program runs batch row {b}'s {n} tokens alone (another call of {top.where}), and {where} attends "
                f"{alone} keys there; in the batch the row's other {len(pads)} tokens are the pad id "
                f"{top.arguments['pad_id']} (token {int(pads[0])}) and each query of the row attends {int(seen[b])} keys "
                f"at the same site: its padding attended as if it were text"),
                expected=f"batch row {b} attending the {alone} keys it attends alone (its pad tokens masked)",
                source=f"the pad id of {top.where}, against the program's run of those tokens alone"))]
    return []


def _token(top, ids: np.ndarray, b: int, k: int) -> str:
    return "handed as embeddings" if "embeds_ids" in top.arguments else f"id {int(ids[b, k])}"


def _cut_short(row: np.ndarray, said: np.ndarray, real: np.ndarray, pad) -> np.ndarray:
    """The tokens of a row that one run keeps real (`said`) and another calls padding (`real` False), where each lies
    after every token the other run keeps and none is the pad id (an int, or None); else none."""
    hidden, kept = np.flatnonzero(said & ~real), np.flatnonzero(real)
    if not len(hidden) or not len(kept) or hidden[0] < kept[-1] or isinstance(pad, int) and (row[hidden] == pad).any():
        return hidden[:0]  # (said only of tokens after all it keeps, none of them a pad id the model states)
    return hidden


def _rows_twice(run: Run, tops: list) -> list:
    """Rows a call states real in its attention_mask that another call of the same model, over the same row, calls
    padding after every token it keeps: the program's own statement of that row against a mask that cuts it short."""
    stated = [(top, ids, _real(top, ids)) for top, ids in tops if getattr(_mask(top), "shape", None) == ids.shape
              and ids.shape[1] >= 3 and (ids.shape[0] > 1 or "embeds_ids" in top.arguments)]
    found, squares = [], {}
    for top, ids in tops:
        real, pad = _real(top, ids), top.arguments.get("pad_id")
        for other, theirs, said_real in stated:
            if other is top or other.where != top.where or theirs.shape[1] != ids.shape[1]:
                continue
            for b in range(ids.shape[0]):
                same = np.flatnonzero((theirs == ids[b]).all(axis=1))
                if len(same) != 1:
                    continue
                hidden = _cut_short(ids[b], said_real[same[0]], real[b], None if "embeds_ids" in top.arguments else pad)
                if not len(hidden):
                    continue
                for one in (top, other):
                    if id(one) not in squares:
                        squares[id(one)] = _square(run, one, ids.shape[1])
                sites = [where for where in squares[id(top)] if where in squares[id(other)]]
                if not sites:
                    continue
                k, n = int(hidden[0]), ids.shape[1]
                found.append((squares[id(top)][sites[0]][0], Finding("unlike-run-alone", (
                    f"the program runs batch row {b} ({n} tokens) as row {int(same[0])} of another call of "
                    f"{top.where}, whose attention_mask keeps tokens {spans(hidden.tolist())} real; but the "
                    f"attention_mask of this call calls them padding after its last real token (token {k}, "
                    f"{_token(top, ids, b, k)}): real tokens of that sequence cut off as if padding"),
                    expected="every token the program's other run of the row keeps real, real here",
                    source=f"the attention_mask of {top.where}, against the program's other run of the same row",
                    cell=(b, k, k))))
                break  # (one finding a call per run that states the row)
    return found


def _first(mine: dict, sites: list, rows: int, i: int, n: int, real: np.ndarray, b: int):
    """(batch call, query, key) of the first real query of the stretch [i, i + n) in batch row `b` that sees a real key
    outside it, at a site the run alone has too; None where none does."""
    outside = real.copy()
    outside[i:i + n] = False
    for where in sites:
        for call in mine[where]:
            cells = _rows(keep(call), rows)
            if cells is None:
                continue
            leak = cells[b, i:i + n] & outside[None, :] & real[i:i + n, None]
            if leak.any():
                q, k = first_cell(leak)
                return call, q + i, k
    return None


RULES = (
    Rule("unlike-run-alone", "wrong", "steps", "a stretch of a batch row, bounded by the row's edges, padding, pad or eos "
         "ids, that the program also runs alone through the same model, hidden as padding or attended otherwise in the "
         "batch (seeing keys outside it)", unlike_run_alone),
)
