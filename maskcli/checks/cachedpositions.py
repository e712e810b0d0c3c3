"""The positions a cached step's queries are numbered at against the positions its prefill gave the keys it cached.

A prefill (a call of as many queries as keys) that states its tokens' positions (trace/positionsat.py: the
`position_ids` its function holds) caches keys at those positions; a later step at the same call site (fewer queries
than keys) that states its own queries' positions continues that sequence: every token it adds comes after the cached
ones, so a query that sees a cached real key must sit after that key's position. A step numbered from fewer tokens
than the cache holds puts its queries inside the cache's range: rotary attention then reads cached tokens as at the
query's own place or after it (OpenTau#72: pi05's action expert counted the prefix's pad mask without its last
`discrete_action_max_length` columns, tokens inference never appends, so the action chunk started at the prompt's
14th position while the cache held 20 real tokens).

Where the cached keys sit among the step's columns is read, not assumed: before its own keys (a cache that grows,
key column j is position j) or after them (`torch.cat([new, cached])`, pi0/pi05), the step's key count saying which
may hold; a layout holds where every real query of the step hides every key the prefill's real queries never saw
(its padding) and sees some key of its own. Only a query wrong under every layout that holds is said. Padding keys
(never seen at the prefill) are not counted; left alone: a step whose keys are fewer than the prefill's and its own
(a window or an evicting cache renumbers), and every later step of its site until the next prefill (the cache they
grow is not the prefill's: EAGLE-2's draft runs a plain causal pass over a chain to check itself, then drafts on
from its own shorter cache), a step over another number of batch rows, cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _rows(held: dict, batch: int) -> np.ndarray | None:
    rows = np.asarray(held["rows"], dtype=np.int64)
    return None if rows.shape[0] not in (1, batch) else np.broadcast_to(rows, (batch, rows.shape[1]))


def _prefill(call):
    """(positions (B, Lp), bool (B, Lp) keys some query of the row sees) of a prefill that states its positions."""
    held, cells = call.details.get("query_positions"), keep(call)
    if held is None or cells is None:
        return None
    batch = max(call.shape[0], cells.shape[0])
    positions = _rows(held, batch)
    if positions is None:
        return None
    real = np.broadcast_to(cells.any(axis=(1, 2)), (batch, cells.shape[-1]))
    if positions.shape != real.shape or any((np.diff(row[seen]) != 1).any() for row, seen in zip(positions, real)):
        return None  # (not one token after the other: ChatGLM's 2-D positions repeat the [gMASK] position)
    return positions, real


def _layouts(q_len: int, k_len: int, p_len: int) -> list:
    """(cache columns start, own columns start) of each layout the step's key count allows."""
    found = [(0, k_len - q_len)] if k_len >= p_len + q_len else []
    if k_len == p_len + q_len:
        found.append((q_len, 0))
    return found


def _judge(seen: np.ndarray, real: np.ndarray, asked: np.ndarray, cached: np.ndarray, q_len: int, start: int,
           own: int) -> tuple | None:
    """(holds, (b, q, k, cached position) of the first query placed at or before a cached real key it sees, or None,
    whether a real query sees any cached real key)."""
    p_len = real.shape[1]
    into = seen[:, :, start:start + p_len]  # (B, Lq, Lp)
    judged = seen.any(axis=2)  # (B, Lq): the step's real queries (a query that sees nothing is padding)
    if (into & ~real[:, None, :] & judged[..., None]).any():
        return False, None, False  # the prefill's padding seen: not this layout (or padding-lost's to say)
    if (judged & ~seen[:, :, own:own + q_len].any(axis=2)).any():
        return False, None, False  # a real query that sees nothing of its own block: not this layout
    live = into & real[:, None, :]
    most = np.where(live, cached[:, None, :], np.iinfo(np.int64).min).max(axis=2)  # (B, Lq)
    bad = judged & live.any(axis=2) & (asked <= most)
    if not bad.any():
        return True, None, bool((judged & live.any(axis=2)).any())
    b, q = (int(x) for x in np.argwhere(bad)[0])
    j = int(np.flatnonzero(live[b, q] & (cached[b] >= asked[b, q]))[0])
    return True, (b, q, start + j, int(cached[b, j])), True


def _applied(call, asked: np.ndarray) -> bool:
    """Whether the positions held are the ones the queries were rotated at, where trace/rotated.py read the rotation
    (each row's first and last): a program that holds position_ids and adds the steps cached on the way to its rotary
    table (HASS / EAGLE-3 TTT, `position_ids + lck`) rotates its queries further on than the name it holds says."""
    rotated = call.details.get("rotated_at")
    rows = None if not rotated else rotated.get("rows")
    if not rows or len(rows) not in (1, asked.shape[0]):
        return True
    at = np.broadcast_to(np.asarray(rows, dtype=np.int64)[:, :2], (asked.shape[0], 2))
    return bool((at[:, 0] == asked[:, 0]).all() and (at[:, 1] == asked[:, -1]).all())


def _skipped(seen: np.ndarray, real: np.ndarray, asked: np.ndarray, cached: np.ndarray, q_len: int,
             k_len: int) -> tuple | None:
    """(b, q, position, last cached position) of the first real query of the first step after the prefill (its keys
    the prefill's and its own, nothing dropped) numbered past the position right after its row's last cached real
    token, under the layout where the cache comes first and where it comes after, alike; None where none is."""
    judged = seen.any(axis=2)  # (B, Lq): the step's real queries
    hit = None
    for b in range(real.shape[0]):
        queries = np.flatnonzero(judged[b])
        if not len(queries) or not real[b].any():
            continue
        last = int(cached[b][real[b]].max())
        q = int(queries[0])
        if int(asked[b, q]) > last + 1:  # (its first real query: the next position after the cache's)
            hit = hit or (b, q, int(asked[b, q]), last)
        else:
            return None  # (a row numbered on from its cache: a numbering that skips in one row alone is padding's)
    return hit


def _past(call, head, held: dict, gap: tuple) -> Finding:
    b, q, at, last = gap
    return Finding("positions-past-cache", (
        f"batch row {b}: query {q} of step {call.step}, the first after the prefill at step {head.step}, is at "
        f"position {at} ({held['name']} of {held['function']}), yet the prefill's last real token sits at position "
        f"{last} and nothing else was cached: position {last + 1} is skipped, so its rotary or position embedding "
        f"reads it one token further on (the tokens counted after the cache grew?)"),
        expected=f"position {last + 1}",
        source=f"{held['name']} of {head.details['query_positions']['function']} at step {head.step}")


def _inside(call, head, held: dict, hit: tuple, cache: tuple, steps: list | None = None) -> Finding:
    """positions-inside-cache's finding: `hit` (b, q, k, cached position), `cache` (positions, real) as judged,
    `steps` the step that cached each of its columns (None: the prefill's alone)."""
    b, q, k, at = hit
    cached, real = cache
    asked = _rows(held, real.shape[0])
    count = int(real[b].sum())
    by = f"the prefill at step {head.step}" if steps is None or k < head.shape[3] else f"step {steps[k]}"
    return Finding("positions-inside-cache", (
        f"batch row {b}: query {q} of step {call.step} is at position {int(asked[b, q])} ({held['name']} of "
        f"{held['function']}), yet it sees key {k}, a real token {by} cached at position {at}: the step's positions "
        f"start inside the cache's, not after its {count} real tokens (numbered from fewer tokens than the cache "
        f"holds?)"),
        expected=f"position {int(cached[b][real[b]].max()) + 1} or after",
        source=f"{held['name']} of {head.details['query_positions']['function']} at step {head.step}",
        cell=(b, q, k))


def _grown(call, grown: tuple | None) -> tuple:
    """(hit or None, the cache as grown): a step that adds its own keys after a cache longer than its site's prefill
    (earlier steps appended, each numbered as its positions stated) judged against every key cached so far, with the
    cache first (the layout a cache that grows has); the cache grown by its positions where it holds and no query
    errs; None from a step that does not append (a window, a rewind, positions not stated) to the next prefill."""
    held = call.details.get("query_positions")
    cells = keep(call)
    if grown is None or held is None or cells is None:
        return None, None
    cached, real, steps = grown
    q_len, k_len = call.shape[2:]
    batch = real.shape[0]
    asked = _rows(held, batch)
    if k_len != real.shape[1] + q_len or max(call.shape[0], cells.shape[0]) != batch or asked is None \
            or not _applied(call, asked):
        return None, None
    seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
    holds, hit, _ = _judge(seen, real, asked, cached, q_len, 0, k_len - q_len)
    if not holds:
        return None, None
    return hit, (np.concatenate([cached, asked], axis=1), np.concatenate([real, seen.any(axis=2)], axis=1),
                 steps + [call.step] * q_len)


def check(run: Run) -> list:
    """Each cached step that states its queries' positions, against its site's latest prefill that stated its own."""
    found = []
    for where, calls in run.sites().items():
        prefill, next_one, grown = None, False, None
        for call in calls:
            q_len, k_len = call.shape[2:]
            if q_len == k_len:
                read = _prefill(call)
                prefill, next_one = None if read is None else (call, *read), True
                grown = None if read is None else (*read, [call.step] * k_len)
                continue
            before = grown
            hit, grown = _grown(call, grown)
            if hit is not None and prefill is not None and before[1].shape[1] > prefill[2].shape[1]:
                found.append((call, _inside(call, prefill[0], call.details["query_positions"], hit, before[:2],
                                            before[2])))
                break  # (keys the steps since the prefill cached, seen by a query numbered at or before them)
            first, next_one = next_one, False  # (the site's first step after its prefill)
            if prefill is not None and k_len < prefill[2].shape[1] + q_len:
                prefill = None  # (fewer keys than the prefill's and its own: a window, a cache cut back or begun anew
                continue  # over other tokens (EAGLE's draft checked by a plain pass); later steps grow that one)
            held = call.details.get("query_positions")
            if prefill is None or held is None or q_len > k_len:
                continue
            head, cached, real = prefill
            cells = keep(call)
            if cells is None or max(call.shape[0], cells.shape[0]) != real.shape[0]:
                continue
            batch = real.shape[0]
            asked = _rows(held, batch)
            if asked is None or not _applied(call, asked):
                continue
            seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
            said = [_judge(seen, real, asked, cached, q_len, start, own)
                    for start, own in _layouts(q_len, k_len, real.shape[1])]
            holding = [one for one in said if one[0]]
            if holding and not any(sees for _, _, sees in holding):
                prefill = grown = None  # (no real query sees a key the prefill cached, whatever the layout: a cache begun anew
                continue  # over the site's fixed columns, DeepSparse's next prompt; its later steps are not the prefill's)
            said = [hit for holds, hit, _ in said if holds]
            if first and said and all(hit is None for hit in said) and k_len == real.shape[1] + q_len:
                gap = _skipped(seen, real, asked, cached, q_len, k_len)
                if gap is not None:
                    found.append((call, _past(call, head, held, gap)))
                    break
            if not said or any(hit is None for hit in said):
                continue
            found.append((call, _inside(call, head, held, said[0], (cached, real))))
            break  # (once a site: every later step repeats it)
    return found


RULES = (
    Rule("positions-past-cache", "wrong", "site", "the first cached step after a prefill whose queries' stated positions "
         "(a position_ids or an offset its function holds) skip past the position right after the prefill's last real "
         "token in every batch row: counted after the cache grew", check),
    Rule("positions-inside-cache", "wrong", "site", "a cached step whose queries' stated positions (a position_ids its "
         "function holds) sit at or before the position its prefill gave a cached real key they see: the step "
         "numbered from fewer tokens than the cache holds", check),
)
