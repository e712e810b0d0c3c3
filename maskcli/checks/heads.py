"""Padding that differs between the heads of one batch row: one row's padding applied to another row's head group.

Every head of a batch row attends over the same tokens, so a key that is padding for one head is padding for
all. A key that no query of head h sees, not even its own position's query, while another head of the same
row lets a query see it, is a key one head calls padding and another real: the mask of some other batch row
(or none) was laid on that head group, as a (B, 1, L, S) mask broadcast against grouped-query scores
(B, kv heads, repeats, L, S) lands batch row b's padding on kv-head group b (ml-explore/mlx-lm#1903).
Heads that differ by their own windows or sinks always let a key's own query see it, so they are quiet; only
calls whose key columns are positions and whose queries include each such key's own position are read.
5-D scores (B, N, R, Lq, Lk) are heads N * R only where N carries the batch's padding (every batch row alike, N's
planes not); where batch rows differ, N is batch-like (OpenFold's MSA rows, a video's frames: each plane its own padding)
and only R is heads (_kv_heads).
Hand-written scores (a softmax) are read only where the program states which axis is heads (_heads_axis): scores in
another order (heads first, or (B, Lq, H, Lk)) taken for (B, H, Lq, Lk) would lay the batch on the heads' place.
Scores whose own values hide cells (trace/finitefill.py's scores_hide: an additive mask read by softmax's zero weights
over scores 1e4 and more apart) are not read: a key no query of one head weighs is then that head's scores, not a mask.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.placing import queries_stated
from maskcli.checks.registry import Rule
from maskcli.checks.topk import reading
from maskcli.text import Finding


def _ranges(values) -> str:
    values = sorted(int(v) for v in values)
    spans, start = [], values[0]
    for before, now in zip(values, values[1:] + [None]):
        if now != before + 1:
            spans.append(f"{start}" if start == before else f"{start}-{before}")
            start = now
    return ", ".join(spans)


def per_head(run: Run) -> list:
    """A key one head of a batch row hides from every query, its own included, that another head of the row shows."""
    found, done = [], set()
    for call in run.calls:
        planes = (call.stored or {}).get("planes")
        if planes is None or planes[1] < 2 or call.shape[0] < 2 or call.details.get("scores_hide") \
                or "topk" in call.details and reading(call):  # (a sparse top-k's mask differs by head on purpose)
            continue  # (one head plane: read off the stored mask's planes, before its cells are made)
        cells = keep(call)
        if cells is None:
            continue
        key = (call.mask, call.shape)
        if key in done:  # (asked first: the same key is never read twice, whatever the checks below say)
            continue
        top, own, positions = run.placed(call)
        if not positions or _unplaced(call, top):
            continue
        done.add(key)
        rows, heads, q_len, k_len = call.shape
        if cells.shape[0] not in (1, rows) or cells.shape[1] != heads:
            continue
        cells = np.broadcast_to(cells, (rows, heads, q_len, k_len))
        lead, per = call.details.get("lead"), 1  # per: planes of the batch-like axis in each batch row
        if lead is not None and not _kv_heads(cells, lead):
            per = lead[1]
            cells = cells.reshape(rows * per, lead[2], q_len, k_len)
        mine = np.zeros(k_len, dtype=bool)  # keys whose own query is one of this call's
        inside = (own >= 0) & (own < k_len)
        mine[own[inside]] = True
        seen = cells.any(axis=2)  # (B, H, Lk)
        odd = ~seen & seen.any(axis=1, keepdims=True) & _own_keys(cells, mine)
        if lead is not None and per == 1:  # (a plane that hides every key is a padded slice of a batch-like axis, an
            odd &= seen.any(axis=2, keepdims=True)  # empty MSA row: no batch row's padding, which leaves it keys)
        if not odd.any():
            continue
        b, h = (int(x) for x in np.argwhere(odd.any(axis=2))[0])
        keys = np.flatnonzero(odd[b, h])
        showing = int(np.flatnonzero(seen[b, :, keys[0]])[0])
        same = all(np.array_equal(cells[r], cells[0]) for r in range(1, cells.shape[0]))
        if not _heads_axis(call, {cells.shape[1], *(lead[2:] if lead else ())}, same):
            continue
        said = "; the mask is the same in every batch row and differs by head instead" if same else ""
        bad_heads = np.flatnonzero(odd[b].any(axis=1))
        b, plane = divmod(b, per)
        found.append((call, Finding("padding-per-head", (
            f"batch row {b}{f' (plane {plane} of its axis before the heads)' if per > 1 else ''}: "
            f"head{'s' if len(bad_heads) > 1 else ''} {_ranges(bad_heads)} "
            f"hide{'' if len(bad_heads) > 1 else 's'} key"
            f"{'s' if len(keys) > 1 else ''} {_ranges(keys)} from every query, {'their' if len(keys) > 1 else 'its'} "
            f"own included, while head {showing} of the same row shows {'them' if len(keys) > 1 else 'it'}{said}: "
            f"one row's padding laid on another row's heads (a batch mask broadcast onto the head axis?)"),
            expected="every head of a batch row pads the same keys", source="the other heads of the same batch row",
            cell=(b, int(keys[0]), int(keys[0])))))  # (the key's own query, as absolute positions)
    return found


def _unplaced(call, top) -> bool:
    """A mask of one row for every query (SDPA's (B, H, 1, Lk) bias, scores masked alike in every row) over more keys
    than queries, where nothing the run states places the queries among the keys (no positions, no cache offset, no
    keys grown by each step's queries): queries() then guesses the end of the keys, and no key is known to be its
    query's own. Such queries are most often not the keys' tokens (kvpress's question queries over a cache each head
    pruned on its own, an OpenFold global attention's one mean query per column), and a key-padding row says nothing
    of where they sit (rows.py's sees-later reads such a mask alike)."""
    q_len, k_len = call.shape[2:]
    return call.details.get("mask_rows") == 1 and q_len < k_len and crossing(call).by != "cache" \
        and not queries_stated(call, top)


def _own_keys(cells: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """(B, H, Lk): the keys whose own query is among each head's queries. `mine` (Lk,) where the queries sit as the
    call places them; but where every plane's query rows are causal rows, each a prefix [0, p] of the keys, the p of
    one plane's rows all distinct and the same query row ending at different p in different heads, each head attends
    its own subset of the queries (Informer's ProbSparse: the causal rows of each head's top-u queries): a key is then
    its own query's in a head only where one of that head's rows ends at it."""
    rows, heads, q_len, k_len = cells.shape
    mine = np.broadcast_to(mine, (rows, heads, k_len))
    if q_len < 2 or heads < 2:
        return mine
    count = cells.sum(axis=3)  # (B, H, Lq): a row is a prefix [0, p] where it keeps p + 1 keys, its last at p
    ends = k_len - 1 - np.argmax(cells[..., ::-1], axis=3)
    ordered = np.sort(ends, axis=2)
    if not ((count > 0) & (ends == count - 1)).all() or (ordered[..., 1:] == ordered[..., :-1]).any() \
            or (ends == ends[:, :1]).all():
        return mine  # (not causal rows, rows ending alike as padding makes them, or every head's queries the same)
    own = np.zeros((rows, heads, k_len), dtype=bool)
    np.put_along_axis(own, ends, True, axis=2)
    return own


def _heads_axis(call, heads: set, same: bool) -> bool:
    """Whether the program states that the axis read as heads is its heads: a kernel's own layout (SDPA, MHA, flex,
    flash take (B, H, ..)), an einsum or permute that laid the scores out (details["axes"], trace/layouts.py), or the
    head count its module holds (details["stated_heads"]) equal to that axis (`heads`: of 5-D scores (B, N, R, ..), N * R
    or R). Hand-written scores in another order
    (heads first, (H, B, Lq, Lk); einsum "bshc,btc->bsht", (B, Lq, H, Lk)) read as (B, H, Lq, Lk) put a batch or
    query axis in the heads' place: a mask alike in every "batch row" and differing by "head" is then the program's
    own padding or causal mask. A head count that contradicts the axis is always quiet; none stated is quiet there."""
    if call.api != "softmax" or "axes" in call.details:
        return True
    stated, given = call.details.get("stated_heads"), call.details.get("query_input")
    if stated is not None and stated > 1 and given and call.shape[0] == given[0] * stated:
        return False  # (the heads already folded into the batch axis, (B * H, N, ..): N is windows or blocks, a
        # blocked local attention's scores (lucidrains' local-attention), whose count may equal the heads')
    return stated in heads if stated is not None or same else True


def _kv_heads(cells: np.ndarray, lead: tuple) -> bool:
    """5-D scores (B, N, R, Lq, Lk) read as (B, N * R) (trace/masks.py): whether N is heads (grouped-query kv heads, head
    g * R + r) rather than a batch-like axis (OpenFold's MSA rows, each with its own padding). Only the axis before the
    queries is heads for certain; N is read as heads where the batch axis says nothing and N does: every batch row masks
    alike while N's planes differ, as a (B, 1, Lq, Lk) mask broadcast against (B, N, R, Lq, Lk) makes them (its batch
    axis lands on N: ml-explore/mlx-lm#1903). Where batch rows differ, each keeps its own padding, and N is batch-like."""
    batch, n, _ = lead
    if batch < 2 or n < 2 or cells.shape[0] != batch:
        return False
    return all(np.array_equal(cells[r], cells[0]) for r in range(1, batch))


RULES = (
    Rule("padding-per-head", "wrong", "call", "a key one head of a batch row hides from every query (its own included) "
         "that another head of the same row shows: one row's padding broadcast onto another row's head group",
         per_head),
)
