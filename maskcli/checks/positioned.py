"""The positions a model call hands its rotary embedding against the keys each query sees (speculative decoding's bugs).

A model call that states its tokens' positions (`position_ids`, or a hand-written model's `positions` / `pos`; or, handed
none, the ones its forward numbers them at: trace/positionsat.py, MosaicGPT's `pos` for `wpe`, mosaicml/examples#257) states
how many tokens precede each query in its sequence; its causal self-attention states which keys each query sees. A
query sits at its own key column (the last `Lq` columns: the cache's keys, then the call's own) and sees nothing to
its right; where those hold, three statements must agree:

- one call: a query that sees every key an earlier query of its row sees, and n more, sits n positions after it (a
  causal row one after the other; a draft tree's node one after its parent, at the root's position plus its depth,
  whatever its index in the flattened tree: mlxcel#1214 placed node i at offset + i); a position that goes back
  starts another packed document, which the documents rules read (arguments.py's documents-leak);
- step to step: where a row's first query sees one key more than the row's last query of the call site's previous
  step (its cache grew by that token, nothing evicted), and that query's keys were as many as its position
  counts, its position is one more (sglang#25015 advanced the draft
  positions before the forward: step 0 at L + 1 over L + 1 keys);
- a call site whose every query so far has seen exactly position + 1 keys: a later query that sees more keys than
  that holds keys of tokens that are not before it (mlc-llm#2939 never rolled the draft model's cache back after
  chain drafting, so the rejected drafts stayed in it).

Rows are the call's batch rows; a site called once per request in one model call (batch 1 each, or rows that are its
module's heads alone, a (heads, Lq, Lk) softmax per request, nano-vllm's attention written out; their queries as many
as the positions, sglang's per-request loop) has the requests for rows. Left alone: a query that sees no key,
its own not or one to its right (padding, a bidirectional span), calls whose queries are not as many as the
positions, multimodal rope's (C, B, L) positions where any token's rows differ (an image's tokens share positions;
a text's three rows, all equal, count as 1-D positions), cross-attention.

A cached step's rotary table is a statement of positions too (trace/ropeat.py reads the cos/sin the attention's
function holds): a query that sees n keys sits at position n - 1 or after, and a table whose positions all stop before
it rotated the query (and the keys with it) before its place (lag-llama 4a2d099). So are the cos/sin factors a call's
queries were multiplied by (trace/rotated.py): where a module's queries see the keys they saw at its previous call of
as many queries and more appended (a cache that grew by a step), and are rotated at the same positions as then, the
step's tokens were rotated where the step before sat (SpecForge#424: EAGLE-3's TTT steps rotated with position_ids,
not position_ids + lck). Where the model call states the step's positions and the table holds them, the table says
what the program says (CogVLM's image tokens share one position: fewer positions than keys).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.checks.startsat import looked_up, starts
from maskcli.checks.renumbered import extra_keys, follows, mark, why as renumbered
from maskcli.text import Finding

NAMES = ("position_ids", "positions", "pos")


def _positions(top) -> tuple[str, np.ndarray] | None:
    """(its name, int64 (rows, T)) of the positions a model call states; None where it states none."""
    for name in NAMES:
        given = top.arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim in (1, 2) and given.size and given.dtype.kind in "iu":
            return name, given.reshape(-1, given.shape[-1]).astype(np.int64)
    return None


def _rope_positions(top) -> np.ndarray | None:
    """The multimodal rope positions a model call states (trace/tops.py's `mrope_position_ids`, (C, B, L): Qwen2-VL's
    3 rows (t, h, w), transformers' 4 with the text row first), or None."""
    rope = top.arguments.get("mrope_position_ids")
    return rope if isinstance(rope, np.ndarray) and rope.ndim == 3 and rope.shape[0] in (3, 4) and rope.size else None


def _text_rope(top) -> tuple[str, np.ndarray] | None:
    """(its name, int64 (B, L)) where the call's multimodal rope positions are a text's (each token's t, h, w equal):
    1-D ones (transformers#40490: Qwen2.5-VL's decode added rope_deltas to positions counted past the padding)."""
    rope = _rope_positions(top)
    if rope is None or not ((rope[-3:] == rope[-1][None]).all()):
        return None
    return "position_ids (multimodal rope, a text's: its three rows equal)", rope[-1].astype(np.int64)


def _held(calls: list) -> tuple[str, np.ndarray, bool] | None:
    """(its name, int64 (rows, Lq), whether the program handed none where the model takes them) of the positions a model
    call's forward numbers its tokens at and looks up in its own position table (trace/positionsat.py: MosaicGPT's
    `pos` in `wpe`; a rotary model's layers may move theirs on, as EAGLE-3's steps do): read at its first call that
    holds them, and only where every call that holds any holds those."""
    held = [call.details["query_positions"] for call in calls if (call.details.get("query_positions") or {}).get("embedded")]
    if not held or any(not np.array_equal(h["rows"], held[0]["rows"]) for h in held[1:]):
        return None
    return (f"{held[0]['name']} held by {held[0]['function']}", np.asarray(held[0]["rows"], dtype=np.int64),
            bool(held[0].get("unhanded")))


def _placed(calls: list, positions: np.ndarray) -> list:
    """(call, row ids (B,), positions (B, Lq)) of each call of one site in one model call; [] where they do not match."""
    rows, length = positions.shape
    lens = [call.shape[2] for call in calls]
    if all(q == length for q in lens):
        found = []
        for call in calls:
            batch = call.shape[0]
            laid = np.broadcast_to(positions, (batch, length)) if rows in (1, batch) else _folded(call, positions)
            if laid is None:
                return []
            found.append((call, np.arange(batch), laid))
        return found
    if rows == 1 and len(calls) > 1 and sum(lens) == length and all(map(_one_request, calls)):
        starts = np.cumsum([0] + lens)  # one call per request, their tokens one after the other (a ragged batch)
        laid = [positions[:, starts[i]:starts[i + 1]] for i in range(len(calls))]
        if any((np.diff(each, axis=1) != 1).any() for each in laid):
            return []  # (a request's new tokens follow one another: a slice that does not was laid over another call,
            # the calls made in another order than the tokens, vLLM's CPU backend: prompts first, its decodes ahead)
        return [(call, np.full(call.shape[0], i), np.repeat(laid[i], call.shape[0], axis=0))
                for i, call in enumerate(calls)]
    return []


def _one_request(call) -> bool:
    """The call's rows are one request's: batch 1, or rows that are its module's heads alone (a (heads, Lq, Lk)
    softmax per request, nano-vllm's attention written out)."""
    return call.shape[0] == 1 or call.shape[1] == 1 and call.details.get("own_heads") == call.shape[0]


def _folded(call, positions: np.ndarray) -> np.ndarray | None:
    """The positions (rows, L) laid over a call whose batch folds each row with its heads or beams (B·n rows): each row
    repeated n times where the call's masks agree within each run of n rows (XGLM's eager (B·H, L, L) softmax,
    generate's expanded beams), tiled where they agree across the n blocks instead; None where neither reads alone."""
    rows, batch = positions.shape[0], call.shape[0]
    cells = keep(call)
    if batch % rows or cells is None or cells.shape[0] != batch:
        return None
    folded, times = cells.any(axis=1), batch // rows
    each = (folded.reshape(rows, times, *folded.shape[1:]) == folded[::times][:, None]).all()
    tiled = (folded.reshape(times, rows, *folded.shape[1:]) == folded[:rows][None]).all()
    repeated, tiles = np.repeat(positions, times, axis=0), np.tile(positions, (times, 1))
    if each and (not tiled or np.array_equal(repeated, tiles)):
        return repeated
    return tiles if tiled and not each else None


def _seen(call, top) -> tuple[np.ndarray, np.ndarray] | None:
    """(bool (B, Lq, Lk) keys each query sees, bool (B, Lq) queries that see their own column and none to its right);
    keys the model call states are padding are not counted (_real; a mask that lets them be seen is
    arguments.py's padding-ignored)."""
    cells = keep(call)
    if cells is None:
        return None
    batch, _, q_len, k_len = call.shape
    seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
    real = _real(top, batch, k_len)
    if real is not None:
        seen = seen & real[:, None, :]
    own = k_len - q_len + np.arange(q_len)
    if own[0] < 0:
        return None
    right = np.arange(k_len)[None, :] > own[:, None]
    placed = seen[:, np.arange(q_len), own] & ~(seen & right[None]).any(axis=2)
    return seen, placed


def _both_ways(seen: np.ndarray, real: np.ndarray | None) -> bool:
    """Some real query (at its own column, the last Lq) sees a real key to the right of that column."""
    _, q_len, k_len = seen.shape
    own = k_len - q_len + np.arange(q_len)
    right = np.arange(k_len)[None, :] > own[:, None]
    later = seen & right[None]
    if real is not None:
        later = later & real[:, own][:, :, None]
    return bool(later.any())


def _real(top, batch: int, k_len: int) -> np.ndarray | None:
    """Bool (B, Lk): the tokens the model call states are real (checks/real.stated: its 0/1 masks, its ids at the pad
    id it holds, its lengths...); None where it states none."""
    said = stated(top, batch, k_len)
    return None if said is None else said[0]


def _within(seen, placed, positions) -> tuple | None:
    """(row, query, earlier query, keys more, positions more) of the first query that extends an earlier one's keys by
    a number its position does not."""
    batch, q_len, k_len = seen.shape
    own = k_len - q_len + np.arange(q_len)
    span = seen[:, :, own] & np.tri(q_len, k=-1, dtype=bool)[None]  # (B, Lq, Lq): earlier queries' keys it sees
    nearest = np.where(span, np.arange(q_len)[None, None], -1).max(axis=2)  # (B, Lq): the last of them, -1 if none
    rows = np.arange(batch)[:, None]
    earlier = np.maximum(nearest, 0)
    counts = seen.sum(axis=2)
    moved = positions - positions[rows, earlier]  # (one that goes back restarts a packed document: documents-leak's)
    rising = (np.diff(positions, axis=1) > 0) | ~(placed[:, 1:] & placed[:, :-1])  # (between real queries: a zigzag
    gaps = (nearest == np.arange(q_len)[None] - 1) & (counts - counts[rows, earlier] == 1) \
        & rising.all(axis=1, keepdims=True)  # rank's chunks padded at 15, 15: 360-LLaMA-Factory's) (the query before it,
    # and itself: a row whose positions only rise skips the places of tokens taken out, an unpadded row kept so)
    bad = placed & (nearest >= 0) & placed[rows, earlier] & ~(seen[rows, earlier] & ~seen).any(axis=2) \
        & (moved > 0) & (counts - counts[rows, earlier] != moved) & ~gaps
    if not bad.any():
        return None
    b, j = (int(x) for x in np.argwhere(bad)[0])
    i = int(nearest[b, j])
    return b, j, i, int(counts[b, j] - counts[b, i]), int(positions[b, j] - positions[b, i])


def _rotated(run: Run, done: set) -> list:
    """Each cached step (fewer queries than keys) whose rotary table (trace/ropeat.py: the cos/sin its function holds)
    encodes no position as far as the keys a query sees count: a query that sees n keys of distinct earlier positions
    sits at n - 1 or after, and a table whose last position is p < n - 1 rotated it before its own place (lag-llama
    4a2d099: RoPE built for seq_len=T=1 at each decode step, the query and every cached key rotated at position 0)."""
    found = []
    for call in run.calls:
        held = call.details.get("rope_positions")
        if held is None or call.where in done:
            continue
        read = _seen(call, run.top(call))
        if read is None:
            continue
        seen, placed = read
        batch = seen.shape[0]
        most = np.asarray(held["most"], dtype=np.int64)
        most = most[:, None] if most.size == batch else np.full((batch, 1), int(most.max()))
        counts = seen.sum(axis=2)
        short = placed & (counts - 1 > most)
        top = run.top(call)
        if top is not None and _rope_positions(top) is not None:
            continue  # (multimodal rope: an image's tokens share positions, so no count of keys says where a query sits)
        said = None if top is None else _positions(top)
        if said is not None and said[1].shape == (batch, seen.shape[1]) and (said[1] <= most).all():
            continue  # (the table holds the positions the model call states for the step: tokens that share one, as
            # CogVLM's image tokens do, count fewer positions than keys)
        if not short.any():
            continue
        b, j = (int(x) for x in np.argwhere(short)[0])
        p, n = int(most[b, 0]), int(counts[b, j])
        k = int(np.flatnonzero(seen[b, j])[p + 1])  # (the first key seen past the p + 1 a position p can count)
        done.add(call.where)
        found.append((call, Finding("positions-vs-keys", (
            f"batch row {b}: query {j} of this cached step sees {n} keys, yet the rotary table {held['name']} of "
            f"{held['function']} encodes no position past {p} ({held['rows']} row{'s' if held['rows'] != 1 else ''}): "
            f"it is rotated at position {p} or before, not {n - 1} or after, so its keys lose their distance to it "
            f"(the table built for the step's own {call.shape[2]} token{'s' if call.shape[2] != 1 else ''}, not "
            f"offset by the {call.shape[3] - call.shape[2]} the cache holds?)"),
            expected=f"position {n - 1} or after", source=f"{held['name']} held by {held['function']}",
            cell=(b, j, k))))
    return found


def _stepped(run: Run, done: set) -> list:
    """Each call whose queries were rotated (trace/rotated.py: the cos/sin factors the program multiplied them by) at
    the very positions the same module's previous call of as many queries rotated them at, though each row's queries
    see keys appended to the ones they saw then (the earlier keys all still seen, more in the columns added): the
    cache grew by a step, so the step's tokens stand that many places further on (SpecForge#424: EAGLE-3's TTT steps
    rotated with position_ids, not position_ids + lck, where the flex path and mrope added the steps cached)."""
    found, last = [], {}
    for call in run.calls:
        held = call.details.get("rotated_at")
        if not held or held.get("module") is None or len(held.get("rows") or ()) not in (1, call.shape[0]):
            continue
        cells = keep(call)
        if cells is None:
            continue
        batch, _, q_len, k_len = call.shape
        seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
        firsts = np.broadcast_to(np.asarray(held["rows"], dtype=np.int64), (batch, 3))  # (first, last, sum) a row
        key = (call.where, held["module"], batch, q_len)
        if q_len == k_len:  # (a square pass of the site: a sequence begun afresh, its cache rebuilt; a step of as many
            for other in [k for k in last if k[:3] == key[:3] and k[3] != q_len]:  # queries before it was another's:
                del last[other]  # Fast-dLLM's block steps of one prompt, then the next prompt's prefill and steps)
        before = last.get(key)
        last[key] = (seen, firsts, k_len)
        if before is None or call.where in done:
            continue
        old, old_firsts, old_len = before
        if old_len >= k_len:
            continue
        kept = ~(old & ~seen[:, :, :old_len]).any(axis=2)  # (B, Lq): every key seen before still seen
        more = seen[:, :, old_len:].sum(axis=2)  # the keys appended that each query sees
        grew = kept & (more > 0) & old.any(axis=2) & (old_firsts == firsts).all(axis=1)[:, None]
        said = stated(run.top(call), batch, q_len)  # (the real queries the model call states, where it states them)
        if said is not None and said[0].shape == grew.shape:
            grew = grew & said[0]
        if not grew.any():
            continue
        b, j = (int(x) for x in np.argwhere(grew)[0])
        k = old_len + int(np.argmax(seen[b, j, old_len:]))
        done.add(call.where)
        found.append((call, Finding("positions-vs-keys", (
            f"batch row {b}: query {j} sees the {int(old[b, j].sum())} keys it saw at this module's previous step and "
            f"{int(more[b, j])} more appended (the cache grew by a step), yet its queries are rotated at the same "
            f"positions as then ({int(firsts[b, 0])} to {int(firsts[b, 1])}): the step's tokens stand {int(more[b, j])} "
            f"further on, and rotated where the step before sat they lose their distance to the keys cached "
            f"(position_ids not offset by the steps cached?)"), expected=f"positions {int(more[b, j])} further on",
            source="the rotary factors (cos/sin) its queries were multiplied by", cell=(b, j, k))))
    return found


def check(run: Run) -> list:
    """Each self-attention call of a model call that states positions, against the keys its queries see."""
    found, last, counted, done, earlier = [], {}, {}, set(), {}
    found += _rotated(run, done)
    found += _stepped(run, done)
    for top in run.tops:
        handed = _positions(top) or _text_rope(top)
        table = handed is None  # (the positions its forward looked up in its own table: _held, _looked_up)
        handed = handed or _held(run.made_by(top)) or looked_up(top)
        if handed is None:
            continue
        name, positions, unhanded = (*handed, False)[:3]
        apart = table and positions.shape[0] > 1 and bool((positions != positions[:1]).any())  # (rows numbered each its
        # own way, looked up in a table: a rotary model's row shifted whole is the same text, CogVLM's left-padded rows)
        absolute = not table and isinstance(top.arguments.get("table_positions"), np.ndarray)  # (positions the call
        # was handed, looked up in a table of absolute positions: a row shifted whole is other text, unsloth#4100; the
        # model's own numbering, handed none, is its statement: BART's decoder counts its columns)
        sites: dict = {}
        for call in run.made_by(top):
            sites.setdefault(call.where, []).append(call)
        for where, calls in sites.items():
            for call, rows, placed_at in _placed(calls, positions):
                read = _seen(call, top)
                if read is None:
                    continue
                seen, placed = read
                if _both_ways(seen, _real(top, call.shape[0], call.shape[3])):
                    counted[where] = False  # (a site whose real queries see later keys: a diffusion model's block, its
                    continue  # cached suffix after it; no count of keys measures a position there, Fast-dLLM's)
                counts = seen.sum(axis=2)
                source = name if table else f"{name} of {top.where}"
                row = top.arguments.get("table_padding_row") if table else None  # (tokens at the table's padding
                real = placed if row is None else placed & (placed_at != row)  # row are its pads: SASRec's)
                start = starts(call, seen, real, placed_at, source, unhanded, absolute, earlier) \
                    if (unhanded or apart or absolute) and where not in done else None
                if start is not None:
                    done.add(where)
                    found.append((call, start))
                if where not in done and not table:  # (a table's positions number the columns, holes and all)
                    hit = _within(seen, placed, placed_at)
                    if hit is not None:
                        b, j, i, more, moved = hit
                        done.add(where)
                        found.append((call, Finding("positions-vs-keys", (
                            f"batch row {b}: query {j} sees the keys query {i} sees and {more} more, yet its position "
                            f"is {moved} after it ({int(placed_at[b, i])} -> {int(placed_at[b, j])}): a token's "
                            f"position counts the tokens before it (a draft tree's node sits at its depth, not its "
                            f"index)"), expected=f"position {int(placed_at[b, i]) + more}", source=source,
                            cell=None)))
                        continue
                good = placed & (placed_at + 1 == counts)
                for b, row in enumerate(rows.tolist()):
                    if where in done or not placed[b].any():
                        continue
                    first, end = int(np.argmax(placed[b])), int(np.flatnonzero(placed[b])[-1])
                    before = last.get((where, row))
                    p, n = int(placed_at[b, first]), int(counts[b, first])
                    ahead = placed[b] & (placed_at[b] + 1 < counts[b])
                    if counted.get(where) and ahead.any() and not table:  # (a table's positions may number
                        # some tokens only: BLIP-2's text after its cached learned queries)
                        q = int(np.argmax(ahead))
                        done.add(where)
                        why = extra_keys(int(counts[b, q] - placed_at[b, q] - 1), int(np.argmax(seen[b, q])))
                        found.append((call, Finding("positions-vs-keys", (
                            f"batch row {b}: query {q} at position {int(placed_at[b, q])} sees {int(counts[b, q])} "
                            f"keys, more than the {int(placed_at[b, q]) + 1} tokens up to it, where every earlier "
                            f"query of this site saw exactly its position's: {why}"),
                            expected=f"{int(placed_at[b, q]) + 1} keys", source=source, cell=None)))
                    elif before is not None and n == before.count + 1 and p != before.position + 1 \
                            and (before.counted or follows(before, seen[b, first], call.shape[0])):
                        done.add(where)
                        pads = int(np.argmax(seen[b, first]))  # (the keys before the row's first seen: its left padding)
                        two = renumbered(before, p, pads)
                        why = two or (f"it counts the row's {pads} padding keys before its first real one (the left "
                                      "padding not subtracted at this step?)" if pads and p - before.position - 1 == pads else
                                      "the position is ahead of the keys it writes (advanced before the forward?)"
                                      if p > before.position else
                                      "the step is numbered from the start again while its key is appended after the "
                                      "cache (the positions not offset by the cache's length?)" if p < before.position
                                      and p <= 1 else
                                      "the position does not move on while the cache grows by a key (a length read "
                                      "off another axis of the cache, its heads? keys of tokens no longer in the "
                                      "sequence kept, not rolled back?)")
                        found.append((call, Finding("positions-vs-keys", (
                            f"batch row {b}: query {first} sees one key more than the site's previous step's last query "
                            f"(at position {before.position}), yet its position is {p}, not {before.position + 1}: {why}"),
                            expected=f"position {before.position + 1}" if two is None else
                            f"one numbering: position {before.position + 1} here, or {p - 1} for the previous step's last query",
                            source=source, cell=None)))
                    last[(where, row)] = mark(int(placed_at[b, end]), int(counts[b, end]), call.shape[0], seen[b, end])
                    # (a step to compare the next against; one whose last query's position does not count its keys is
                    # read only by a next step that sees its keys and one more: checks/renumbered.py)
                if placed.any():
                    counted[where] = counted.get(where, True) and bool((good == placed).all())
    return found


RULES = (
    Rule("positions-vs-keys", "wrong", "steps", "a query whose stated position (position_ids, positions, pos) does not "
         "count the keys it sees: one that extends an earlier query's keys by n keys sits other than n positions after "
         "it (a draft tree's node at its index, not its depth), a step whose cache grew by one key moves the position "
         "by other than one, or a query sees more keys than its position counts where the site's every earlier query "
         "saw exactly those; or a cached step's rotary table (cos/sin) encodes no position as far as its keys count; or a "
         "module's queries that see keys appended to those of its previous step are rotated at that step's positions",
         check),
)
