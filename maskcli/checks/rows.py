"""Rows: query rows that see no key, and queries that see keys after their own position.

Each rule is one code with a check per what it reads: a trace group's stored mask (trace's report), a tensor a user
gave (inspect), the mask attend and verify run on a device (stages.py's mask_findings, declared here as the rule's).
"""

from __future__ import annotations

import numpy as np

from maskcli import tracefile
from maskcli.checks.context import cross, tril, triu
from maskcli.checks.emptyreal import context_masked_whole, real_but_empty
from maskcli.checks.gatheredrows import gathered_rows
from maskcli.checks.kernelrows import what_api_does
from maskcli.checks.real import by_row
from maskcli.checks.registry import Rule
from maskcli.checks.stages import mask_findings as mask_rows
from maskcli.checks.rowwords import all_padding, pooled_keys
from maskcli.checks.tiled import key_tile, tile_columns
from maskcli.text import Finding, plane_text, spans

MEANT_LATER = (None, "tril", "triu")  # kinds that mean later keys (full, segment, blocks, ...) are not flagged


def empty_rows(call, stored: dict, structure) -> list[Finding]:
    """A trace group's query rows that see no key, with what its API makes of them."""
    # rows the kernel gives 0 are routine (left padding); NaN out of a softmax of the program's own may be zeroed by
    # the program after it (CPM-Ant's masked_fill(score, ~mask, 0)), which a trace does not see: suspicious there
    severity = "note" if "NaN" not in what_api_does(call) else "suspicious" if call.api == "softmax" else "wrong"
    if call.details.get("nan_scores") or key_tile(call):
        return []  # (NaN scores read as no key: rows the mask kept, not emptied by it; nans.py says where from; a tile
        # of a blockwise loop over other keys than its queries': its rows see keys in other tiles, tiled.py)
    if stored["form"] == "stats":
        return [Finding("fully-masked", f"{stored['empty_rows']:,} query rows see no key at all: {what_api_does(call)}",
                        severity)] if stored["empty_rows"] else []
    none = tracefile.counts(stored) == 0  # (b, h, Lq)
    empty = none.any(axis=1)  # (b, Lq): over the heads
    if not empty.any():
        return []
    parts = []
    for batch in np.flatnonzero(empty.any(axis=1)).tolist()[:8]:
        rows = np.flatnonzero(empty[batch]).tolist()
        where = f" of batch row {batch}" if empty.shape[0] > 1 else ""
        parts.append((f"query row {rows[0]}" if len(rows) == 1 else f"query rows {spans(rows[:200])}") + where)
    more = int(empty.any(axis=1).sum()) - len(parts)
    who = "; ".join(parts) + (f"; and {more} more batch rows" if more > 0 else "")
    verb = "sees" if len(parts) == 1 and parts[0].startswith("query row ") and not parts[0].startswith("query rows") else "see"
    if none.all() and call.shape[3] > 0 and not cross(call) and (said := all_padding(call)) is not None:
        return [Finding("fully-masked", f"every query of every batch row sees no key at all: {said} calls "
                        f"every token padding ({what_api_does(call)})", "note")]
    if none.all() and call.shape[3] > 0 and not cross(call):
        # every query of a self-attention, each of which may at least see itself: the mask hides all there is (an
        # all-True mask handed where True = masked), so the kernel's output is no attention the program meant; in every
        # head (rows empty in some heads only are no mask that masks everything: Longformer's banded scores, (B, L, H,
        # 2w + 1) read as (B, H, Lq, Lk), have their padded positions zeroed on the axis read as heads)
        return [Finding("fully-masked", f"every query of every batch row sees no key at all, in a self-attention whose "
                        f"queries are its own keys: the mask masks everything ({what_api_does(call)})", "wrong",
                        expected="each query sees at least its own key", cell=(0, 0, 0))]  # (its first cell,
        # masked as every other is)
    orphan = real_but_empty(call, stored, empty)
    whole = context_masked_whole(call, stored, empty, what_api_does(call))
    if whole is not None:
        return [whole]
    if orphan is not None:
        b, q, why = orphan
        return [Finding("fully-masked", (
            f"query {q} of batch row {b} sees no key at all, not even its own, though {why}: {what_api_does(call)}"),
            "wrong", expected="each query whose token is real sees at least its own key", cell=(b, q, q))]
    return [Finding("fully-masked", f"{who} {verb} no key at all: {what_api_does(call)}", severity)]


def reach(stored: dict, q_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) key each query row sees, (b*h, Lq); Lk and -1 where a row sees none."""
    if stored["form"] == "intervals":
        found = tracefile.intervals(stored)
        real = found.starts < found.ends
        first = np.where(real, found.starts, found.k_end).min(axis=-1)
        last = np.where(real, found.ends - 1, -1).max(axis=-1)
    else:
        cells = tracefile.dense(stored)
        cells = cells.reshape(-1, *cells.shape[2:])
        k_len, seen = cells.shape[-1], cells.any(axis=-1)
        first = np.where(seen, cells.argmax(axis=-1), k_len)
        last = np.where(seen, k_len - 1 - cells[..., ::-1].argmax(axis=-1), -1)
    return np.broadcast_to(first, (first.shape[0], q_len)), np.broadcast_to(last, (last.shape[0], q_len))


def later(call, stored: dict, structure, real=None, past=None, places=None) -> list[Finding]:
    """A query of a trace group that sees a key after its own position, the queries placed at the end of the keys.

    `real`: bool (B, Lk) the tokens the model call states real (stated_tokens), or a function giving it or None, asked
    only where some query sees a later key. Its padding queries are left out (a padding row's output is never used,
    whatever it sees: a left-padded row's last padding query over the real keys after it, at GPT-2's -1e4), and a mask
    no kind names is judged on its real queries over its real keys alone (the runs of later keys that padding rows see
    say nothing of a causal mask's slip; keys the program states padding are the padding rules', not a causal order's).
    Where it states none, such a mask has its padding rows read off its cells (_read_queries): only the real ones are
    said, and the tests read the cells whole (a guess from the cells does not reshape them). `past`: a function saying
    whether the model call states its queries past every key (past_the_keys): then no key is later than a query.
    `places`: a function giving the queries' key positions the model call states (stated_places), used instead."""
    from maskcli.checks.sides import encoder_path

    if structure is not None and structure.expression is not None and structure.kind not in MEANT_LATER:
        return []
    if call.api in ("flash", "hf") and not call.details.get("causal"):
        return []  # not causal: the later keys in its window are the ones it asked for
    if cross(call) or encoder_path(getattr(call, "where", "")):
        return []  # a decoder's queries over its encoder's memory: no query has a position among those keys; an
        # encoder's self-attention (its module path says so: LongT5's blocked transient-global layers) sees both ways
    if pooled_keys(call):
        return []  # an engine's pool of cache slots: no query has a place among its columns (vLLM's flex over its pages)
    if call.details.get("mask_rows") == 1:
        return []  # one mask row broadcast to every query (a key padding mask, or GQA heads packed as rows): no query order
    if gathered_rows(call, stored):
        return []  # (causal rows gathered by query, out of order: ProbSparse's top-u queries, checks/gatheredrows.py)
    q_len, k_len = call.shape[2:]
    own = k_len - q_len + np.arange(q_len)  # bottom-right: query i sits at key position Lk - Lq + i
    seeing = reach(stored, q_len)[1] > own[None, :]  # (b*h, Lq)
    if not seeing.any() or past is not None and past():
        return []
    columns = tile_columns(call)  # (a tile of a blockwise kernel: its queries at their places among its keys)
    if columns is not None and not (reach(stored, q_len)[1] > columns[None, :]).any():
        return []
    stated = places() if places is not None and q_len < k_len else None
    if stated is not None:  # (where the program says they sit: a static cache's slots past them are unwritten)
        own, seeing = stated, reach(stored, q_len)[1] > stated[None, :]
        if not seeing.any():
            return []
    real = real() if callable(real) else real
    b, h = stored["planes"]
    if real is not None and q_len <= k_len and real.shape[1] == k_len and b in (1, real.shape[0]):
        seeing = seeing.reshape(b, h, q_len).any(axis=1) & real[:, own]  # (B, Lq): the real queries that see later keys
    else:
        real = None
    rows = np.flatnonzero(seeing.any(axis=0))
    unnamed = structure is not None and structure.kind is None and stored["form"] != "stats"
    if len(rows) and unnamed:  # (a mask no kind names: its cells read once for every test below)
        cells = tracefile.dense(stored)
        if real is None:  # (read off the cells, which stay whole: a mask built both ways is read as it was built)
            ahead = (by_row(cells) & (np.arange(k_len)[None, None, :] > own[None, :, None])).any(axis=-1)  # (B, Lq)
            rows = np.intersect1d(rows, np.flatnonzero((ahead & _read_queries(cells, own)).any(axis=0)))
        else:  # (the program's word: its padding queries and keys out, so that every test below reads real ones)
            cells = np.broadcast_to(cells, (max(real.shape[0], cells.shape[0]), *cells.shape[1:])) \
                & real[:, None, own, None] & real[:, None, None, :]
        planes = cells.reshape(-1, q_len, k_len)
        run = _next_run(planes, q_len, k_len)
        # a slip of a causal mask (one key off, the wrong way round) reaches the keys right after the query; keys seen
        # only further on, past one the query does not see, are another stream's (BD3-LM's noised block over the
        # clean copy of the sequence laid after it), which no slip of a triangle makes
        rows = np.intersect1d(rows, np.flatnonzero(run.any(axis=(0, 2))))
    if len(rows) == 0 or unnamed and (_both_ways(cells, q_len, k_len) or _spans(planes, run, q_len, k_len)):
        return []
    shown = spans(rows[:200].tolist())
    if unnamed and not _slip(planes, run, own):
        return [Finding("sees-later", f"query rows {shown} see later keys (queries placed at the end of the keys), in "
                        "runs no slip of a causal mask makes (of differing lengths, or past keys it does not see): a mask meant "
                        "both ways in places?",
                        "note")]
    return [Finding("sees-later", f"query rows {shown} see later keys (queries placed at the end of the keys): "
                    "a causal mask with an off-by-one, or one read the wrong way round?")]


def stated_tokens(run, calls: list) -> np.ndarray | None:
    """Bool (B, Lk): the tokens of a trace group's keys (calls that share mask and shape) the model call states real
    (checks/real.py stated: its attention_mask, lengths, ...), every call's model call stating the same; None where one
    states none, or the group attends across (its queries' tokens are no keys of it)."""
    from maskcli.checks.real import stated

    if run is None or not calls or cross(calls[0]):
        return None
    rows, _, _, k_len = calls[0].shape
    said = [stated(run.top(call), rows, k_len) for call in calls]
    if any(s is None for s in said) or any(not np.array_equal(s[0], said[0][0]) for s in said[1:]):
        return None
    return said[0][0]


def _slip(cells: np.ndarray, run: np.ndarray, own: np.ndarray) -> bool:
    """The later keys seen as a causal mask's slip lays them: every query that sees some sees as many right after its
    own (the diagonal moved by that many), or every one sees on to the last key its batch row sees (the triangle the
    wrong way round); runs of differing lengths that stop short are a mask built both ways in places (BD3-LM), and so
    is a later key seen past one the query does not see (a graph's adjacency: a ring's wrap): a slip skips no key, and
    so are rows that come in runs of equal rows (a triangle's rows differ one from the next).
    `own`: each query's own key (later's placement)."""
    k_len = cells.shape[-1]
    if (cells & (np.arange(k_len)[None, None, :] > own[None, :, None]) & ~run).any():
        return False
    counts = run.sum(axis=-1)
    has = counts > 0
    same = np.zeros_like(has)  # (B*H, Lq): a query that sees what the query before or after it sees, key for key
    if cells.shape[1] > 1:
        equal = (cells[:, 1:] == cells[:, :-1]).all(axis=-1)
        same[:, 1:] |= equal
        same[:, :-1] |= equal
    if same[has].all():
        return False  # (rows in runs of equal rows: blocks of queries, DN-DETR's denoising groups; no triangle's slip)
    if len(np.unique(counts[has])) <= 1:
        return True
    last = k_len - 1 - cells.any(axis=1)[:, ::-1].argmax(axis=-1)  # (B*H,): the last key any query of the plane sees
    run_end = k_len - 1 - run[..., ::-1].argmax(axis=-1)
    return bool((run_end[has] == np.broadcast_to(last[:, None], has.shape)[has]).all())


def past_the_keys(run, calls: list) -> bool:
    """Every call of a trace group (calls that share mask and shape) is made by a model call that states its first
    query's position (context.STARTS: start_pos, query_offset, ...) at or past the call's last key: its queries' own
    tokens are no keys of it (an MTP drafter's queries over the target's cache, a block that attends to a cache it is
    not written into), so every key precedes every query, and no placement among the keys (bottom-right, or top-left
    at a static cache's start) is where the program says they sit."""
    from maskcli.checks.context import STARTS

    if run is None or not calls:
        return False
    k_len = calls[0].shape[3]
    for call in calls:
        top = run.top(call)
        given = {} if top is None else top.arguments
        if not any(isinstance(given.get(name), int) and given[name] >= k_len for name in STARTS):
            return False
    return True


def stated_places(run, calls: list) -> np.ndarray | None:
    """Int (Lq,): the key position of each query that every call's model call states (`cache_position`, `input_pos`:
    a static cache's slot j is position j, checks/context.queries), the same for all; None where one states none."""
    from maskcli.checks.context import columns_are_positions, queries

    found = None
    for call in calls if run is not None else ():
        top = run.top(call)
        given = {} if top is None else top.arguments
        if not any(isinstance(given.get(name), np.ndarray) and given[name].shape[-1:] == (call.shape[2],)
                   for name in ("cache_position", "input_pos")) or not columns_are_positions(call, top):
            return None
        own = queries(call, top)
        if found is not None and not np.array_equal(found, own) or own.min(initial=0) < 0 \
                or own.max(initial=0) >= call.shape[3]:
            return None
        found = own
    return found


def _read_queries(cells: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Bool (B, Lq): the real queries of keep cells (b, h, Lq, Lk) read off them where the model call states none
    (checks/real.py read_off): the padding rows of a left-padded batch that Hugging Face's SDPA path lets see every key
    are not real. Nor is a row that sees every key while the other rows of its batch row do not and whose own key no
    query after it sees, in a batch of one row too: a padding row left unmasked, as GPT-2's -1e4 leaves the last one of
    a left-padded row (its keys all -1e4 or near it); a causal mask one key off has such a full row too, whose key the
    next row sees."""
    from maskcli.checks.real import read_off

    planes = by_row(cells)
    q_len, k_len = planes.shape[1:]
    full = planes.all(axis=-1) & (q_len > 1) & (own < k_len - 1)[None, :]  # (as read_off reads them: the last query
    full &= ~full.all(axis=1, keepdims=True)  # of a causal mask sees every key)
    if full.any():
        column = planes[:, :, np.clip(own, 0, k_len - 1)]  # (B, row r, query q): r sees q's own key
        full &= ~tril(column, k=-1).any(axis=1) & (own >= 0)[None, :]  # (no row after q sees it)
    real = read_off(planes, own)[1] if planes.shape[0] > 1 else np.ones_like(full)
    return real & ~full


def _next_run(cells: np.ndarray, q_len: int, k_len: int) -> np.ndarray:
    """Bool (B*H, Lq, Lk) of `cells` (B*H, Lq, Lk): the later keys each query sees in one run from the key right after
    its own (bottom-right)."""
    at = np.arange(k_len)[None, None, :]
    own = (k_len - q_len + np.arange(q_len))[None, :, None]
    return np.logical_and.accumulate(cells | (at <= own), axis=-1) & (at > own)


def _both_ways(cells: np.ndarray, q_len: int, k_len: int) -> bool:
    """Every later key a query sees sees that query back, and the queries that see later keys see each other
    symmetrically (bidirectional spans: image blocks, a symmetric window; the queries at the end of the keys): a mask
    meant both ways there, which no expression named, not an off-by-one. A causal mask one key off (tril(1)) passes the
    first test but not the second, padded or not."""
    if q_len != k_len:
        return False
    planes = cells.reshape(-1, q_len, k_len)
    back = np.swapaxes(planes, -1, -2)
    if (triu(planes, k=1) & ~back).any():
        return False
    # and among the queries that see later keys, each sees those earlier ones that see it: a window or a span is
    # symmetric there; a causal mask one key off (tril(1)) sees every earlier key and is seen by one
    ahead = triu(planes, k=1).any(axis=-1)  # (B*H, Lq)
    among = ahead[:, :, None] & ahead[:, None, :]
    return not bool((among & (planes != back)).any())


def _spans(cells: np.ndarray, later: np.ndarray, q_len: int, k_len: int) -> bool:
    """The later keys each query sees are the rest of a span it is in, as bidirectional spans make them (Gemma 3's
    images, a prefix) whatever cuts the keys before (a sliding window shorter than an image: its first token sees the
    image's last, which sees back only the window): query i at key Lk - Lq + i sees the keys (i, e] and no other later
    one, the queries after it up to e see on to the same e and the key before them, and e sees none later. A causal
    mask one key off (tril(1)) has no such span; a mask read the wrong way round sees no key before its queries.
    `cells` (B*H, Lq, Lk); `later` their _next_run (keys seen only past an unseen one: no span's, no slip's)."""
    own = k_len - q_len + np.arange(q_len)
    has = later.any(axis=-1)
    last = np.where(has, k_len - 1 - later[..., ::-1].argmax(axis=-1), -1)
    if not (~has | (later.sum(axis=-1) == last - own)).all():  # the later keys are one run from the next key on
        return False
    if not (~has | cells[:, np.arange(q_len), own]).all():  # a query in a span sees itself
        return False
    going = has[:, :-1]  # query i's span goes on to query i + 1, which must end where it does and see query i's key
    ends = np.where(last[:, :-1] > own[:-1] + 1, last[:, :-1], -1)
    return bool((~going | ((last[:, 1:] == ends) & cells[:, np.arange(1, q_len), own[:-1]])).all())


def given_empty_rows(keep4: np.ndarray, reading: str, q_offset: int = 0) -> list[Finding]:
    """Query rows of a tensor a user gave (inspect) that see no key; a key padding mask's batch rows that hide every key."""
    empty = ~keep4.any(axis=-1)  # (B, H, Lq)
    if reading == "key padding [B, S]":
        batch_rows = np.flatnonzero(empty[:, 0, 0]).tolist()
        if not batch_rows:
            return []
        who = f"batch row {batch_rows[0]} hides" if len(batch_rows) == 1 else f"batch rows {spans(batch_rows)} hide"
        return [Finding("fully-masked", f"{who} every key: a length-0 sequence, whose queries see no key at all")]
    found = []
    for b, h in np.argwhere(empty.any(axis=-1)).tolist():
        if h > 0 and np.array_equal(empty[b, h], empty[b, 0]):
            continue  # the same rows as head 0: said once
        rows = [q_offset + i for i in np.flatnonzero(empty[b, h]).tolist()]
        who = f"query row {rows[0]} sees" if len(rows) == 1 else f"query rows {spans(rows)} see"
        found.append(Finding(
            "fully-masked",
            f"{who} no key at all{plane_text(b, h, keep4.shape)}: softmax over nothing, NaN with an -inf fill and "
            "uniform weights over the masked keys with a finite one (maskcli verify shows what each backend does)",
        ))
    return found


def given_later(keep4: np.ndarray, structure, q_offset: int = 0) -> list[Finding]:
    """Queries of a tensor a user gave (inspect) that see later keys, where no kind that means them rebuilds it."""
    # later keys are worth a word unless a kind that means them rebuilds the mask (tril/triu mean them only by accident)
    if structure.reading != "mask" or structure.kind not in MEANT_LATER:
        return []
    q_len, k_len = keep4.shape[-2:]
    if q_len > k_len:
        return []  # more queries than keys: a cross-attention's, whose queries have no place among its keys
    later = triu(keep4, k=k_len - q_len + 1)  # on the last two axes
    rows = np.flatnonzero(later.any(axis=-1).any(axis=(0, 1))).tolist()
    if not rows:
        return []
    b, h = (int(x) for x in np.argwhere(later[..., rows[0], :].any(axis=-1))[0])
    keys = np.flatnonzero(later[b, h, rows[0]]).tolist()
    plane = plane_text(b, h, keep4.shape).strip(" ()")
    example = f"query {q_offset + rows[0]} sees key{'s' if len(keys) > 1 else ''} {spans(keys)}" + (f" in {plane}" if plane else "")
    shown = [q_offset + r for r in rows]
    who = f"query row {shown[0]} sees" if len(rows) == 1 else f"query rows {spans(shown)} see"
    if structure.kind is not None:
        message = (f"{who} later keys ({example}): {structure.expression} "
                   "reaches past the diagonal, which a causal mask does not (an off-by-one?)")
    elif len(rows) < q_len / 2:
        message = f"{who} later keys while the others do not: an off-by-one in a causal mask? ({example})"
    else:
        message = f"{who} later keys ({example}): a bidirectional mask, or one read the wrong way round?"
    return [Finding("sees-later", message)]


def tensor_rows(a, _heads=None) -> list[Finding]:
    """A tensor a user gave (inspect's Analysis, taken as it comes): rows that see no key, then queries that see later
    keys, at the query positions its structure places them."""
    return given_empty_rows(a.keep4, a.structure.reading, a.q_offset) + given_later(a.keep4, a.structure, a.q_offset)


def group_cells(g) -> list[Finding]:
    """A trace group's rows (checks/grouped.py): those that see no key, then those that see later keys (read off the
    rows, so not where the mask was kept as counts only)."""
    found = empty_rows(g.first, g.stored, g.structure)
    if g.stored["form"] != "stats":
        found += later(g.first, g.stored, g.structure, g.real, lambda: g.past, lambda: g.places)
    return found


RULES = (
    Rule("fully-masked", "note", "call", "query rows that see no key: wrong where the kernel turns them into NaN, "
         "suspicious where a softmax of the program's does (it may zero them after), a note where the kernel gives 0 (the "
         "padding query rows of a left-padded batch)", group_cells, "cells",
         also=(("tensor", tensor_rows), ("mask", mask_rows))),
    Rule("sees-later", "suspicious", "call", "queries that see keys after their own position in a mask no kind names "
         "(a causal mask off by one, or read the wrong way round)", group_cells, "cells",
         also=(("tensor", tensor_rows), ("mask", mask_rows))),
)
