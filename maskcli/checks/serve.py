"""The rules that find a wrong serving batch (maskcli serve): a batch's metadata comes in from an engine's fields
(maskcli/serve/), the rules here and in servemasks.py check it, and serve's views show what they found.

Each rule is a small function of a batch (maskcli.serve.batch.ServeBatch, taken as it comes: this package sits below
serve/ and imports nothing of it) returning Findings that name their request and the first wrong cell (query
position, key position), absolute, where one exists. Rules are vectorised over requests and pages: O(requests +
pages + tokens). They stay quiet on what engines do on purpose: null blocks out of a sliding window, full pages
shared by prefix caching, padding slots (-1) after the batch's tokens. `check` (servecheck.py: outside the rules'
modules, so that the registry climbs back into none of them) runs every rule given one batch's `metadata`; servesteps.py (a request's steps across files) and serveexpect.py (--expect,
--model) are called by serve with what else they read.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.pagemap import distinct, page_map, read_range
from maskcli.checks.registry import Rule
from maskcli.checks.servecheck import check  # noqa: F401  (servecheck's: for the callers that name this module)
from maskcli.text import Finding


def first_true(bad: np.ndarray) -> int | None:
    """The first index where `bad` holds, None where none."""
    hit = np.flatnonzero(bad)
    return int(hit[0]) if hit.size else None


def tokens_agree(b) -> bool:
    """The query offsets split q's tokens as q holds them (else per-token rules would blame the wrong request)."""
    return b.tokens is None or int(b.q_indptr[-1]) == b.tokens


def first_positions(b) -> np.ndarray:
    """Each request's first new token's position: as the cache says where it says, else as the kernel aligns it."""
    return b.computed if b.computed is not None else b.q_start


def lengths(b) -> list[Finding]:
    """seq_len = computed + new; the query count is the new tokens q holds; no request with queries and no keys."""
    out = []
    q_lens, seq = b.q_lens, b.seq_lens
    keyless = (q_lens > 0) & (seq == 0)
    r = first_true(keyless)
    if r is not None:
        out.append(Finding("no-keys", f"request {r} has {int(q_lens[r])} {'query' if q_lens[r] == 1 else 'queries'} and 0 keys ({b.name('seq_lens')} "
                           f"is 0): its rows are empty, the kernel writes zeros or NaN there", request=r))
    r = first_true((q_lens > seq) & (seq > 0))
    if r is not None:
        out.append(Finding("more-queries-than-keys", f"request {r} has {int(q_lens[r])} new tokens but {int(seq[r])} keys: "
                           f"the keys include the new tokens, so {b.name('seq_lens')} must be at least {b.name('queries')}'s count", request=r))
    counted = b.tokens is not None and int(b.q_indptr[-1]) != b.tokens
    said_count = (f"{b.name('queries')} counts {int(b.q_indptr[-1])} query tokens but {b.name('writes')} has {b.tokens}"
                  if counted else "")
    if b.computed is not None:
        bad = (b.computed + q_lens != seq) & ~keyless  # a request with no keys is no-keys' finding, once
        r = first_true(bad)
        if r is not None:
            said, new, keys = int(b.computed[r]), int(q_lens[r]), int(seq[r])
            at = keys - new  # where the kernel puts the first query
            cell = (said, min(said, at) + 1) if at >= 0 else None
            full = new == keys and said > 0
            why = (f"{b.name('queries')} counts request {r}'s full length {keys}, where q holds only its {keys - said} new tokens"
                   if full else f"{b.name('seq_lens')} {keys} is not {b.name('computed')} {said} + {new} new")
            # offsets built from full lengths count each such request's cached tokens once more: one bug, one finding
            explained = counted and bool(np.all((q_lens == seq)[bad])) and int(b.computed[bad].sum()) == int(b.q_indptr[-1]) - b.tokens
            out.append(Finding("seq-len", f"{why}: the kernel puts its first query at position {at}, "
                               f"the cache says {said} ({int(bad.sum())} request{'s' if bad.sum() != 1 else ''} like this)"
                               + (f"; {said_count}" if explained else ""), request=r, cell=cell))
            counted = counted and not explained
    if counted:
        out.append(Finding("query-count", f"{said_count}: q holds {b.tokens} new tokens, the offsets must count only those"))
    return out


def pages(b) -> list[Finding]:
    """The page table covers exactly the keys; no null page where keys are read; shared pages full and unwritten."""
    if b.page_size == 0:
        return []
    out = []
    ps = b.page_size
    if b.short_table is not None and b.short_table.any():
        r = first_true(b.short_table)
        out.append(Finding("table-short", f"request {r}'s {b.name('table')} row has fewer blocks than its "
                           f"{int(b.seq_lens[r])} keys need ({-(-int(b.starts[r] + b.seq_lens[r]) // ps)} of {ps} tokens)", request=r))
    if b.last_fill is not None:
        counts = np.diff(b.page_indptr)
        bad = (counts > 0) & ((b.last_fill < 1) | (b.last_fill > ps))
        r = first_true(bad)
        if r is not None:
            out.append(Finding("last-page-fill", f"request {r}'s {b.name('last')} is {int(b.last_fill[r])}: a last "
                               f"page holds 1 to {ps} tokens (page_size {ps})", request=r))
    m = page_map(b)
    owner, column = m.owner, m.column
    first, _ = read_range(b)
    i = first_true(m.read & (b.pages < 0))
    if i is not None:
        r = int(owner[i])
        out.append(Finding("bad-page", f"request {r}'s logical block {int(column[i])} is page {int(b.pages[i])}, "
                           f"which is no page: the keys there are read from outside the cache", request=r))
    i = first_true(m.read & m.null)
    if i is not None:
        r = int(owner[i])
        key = max(int(column[i]) * ps, int(first[r])) - int(b.starts[r])
        kind = f"sliding-window layer (window {b.window}) reads it inside its window" if b.window else "full-attention layer reads it"
        out.append(Finding("null-page", f"request {r}'s logical block {int(column[i])} is the null page {b.null_page}, and its {kind}: "
                           f"keys {key}..{min(key + ps, int(b.seq_lens[r])) - 1} read nothing that was written",
                           request=r, cell=(int(b.q_start[r]) + max(0, key - int(b.q_start[r])), key)))
    out += _shared(b, m)
    out += _writes(b)
    return out


def _shared(b, m) -> list[Finding]:
    out = []
    ps = b.page_size
    real = m.read & ~m.null
    owner, column = m.owner, m.column
    key = b.pages[real] * max(b.requests, 1) + owner[real]
    if distinct(key).size < key.size:  # one request listing one page at two logical blocks
        order = np.lexsort((column[real], owner[real], b.pages[real]))
        p, o, c = b.pages[real][order], owner[real][order], column[real][order]
        i = first_true((p[1:] == p[:-1]) & (o[1:] == o[:-1]))
        out.append(Finding("page-twice", f"request {int(o[i])} reads page {int(p[i])} as logical blocks "
                           f"{int(c[i])} and {int(c[i + 1])}: two blocks of keys cannot live on one page", request=int(o[i])))
    i = first_true(m.shared & (m.fill < ps))
    if i is not None:
        r, page = int(owner[i]), int(b.pages[i])
        others = sorted(set(owner[m.shared & (b.pages == page)].tolist()) - {r})
        out.append(Finding("shared-page-partial", f"page {page} is shared by requests {r} and {others[0]}, but it is "
                           f"request {r}'s partly filled last block ({int(m.fill[i])} of {ps}): only full pages are shared, a "
                           f"partial one is still being written", request=r))
    i = first_true(m.shared & m.written)
    if i is not None:
        out.append(_shared_written(b, m, int(b.pages[i])))
    return out


def _writers(b, m, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(requests, positions, slots) of the new tokens written on `page` this step, in token order."""
    ps = b.page_size
    if b.write_slots is not None:
        t = np.flatnonzero((b.write_slots >= 0) & (b.write_slots // ps == page))
        r = np.minimum(np.searchsorted(b.q_indptr, t, side="right") - 1, b.requests - 1)
        return r, first_positions(b)[r] + t - b.q_indptr[r], b.write_slots[t]
    # no slots: the kernel appends each request's new tokens at its positions (pagemap marks those blocks written)
    new_from = (b.starts + np.maximum(b.q_start, 0))[m.owner]
    j = np.flatnonzero((b.pages == page) & ((m.column + 1) * ps > new_from))
    lo = np.maximum(m.column[j] * ps, new_from[j])
    count = np.maximum(np.minimum((m.column[j] + 1) * ps, (b.starts + b.seq_lens)[m.owner[j]]) - lo, 0)
    r = np.repeat(m.owner[j], count)  # one entry per token written, at most page_size per block
    column = np.repeat(lo, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return r, column - b.starts[r], page * ps + column % ps


def _shared_written(b, m, page: int) -> Finding:
    """A shared page written this step, named by who writes where and which key of another request that overwrites."""
    ps = b.page_size
    on_page = m.read & (b.pages == page)
    readers = sorted(set(m.owner[on_page].tolist()))
    writers, positions, slots = _writers(b, m, page)
    victim = next((r for r in readers if r != int(writers[0])), readers[0])
    j = int(np.flatnonzero(on_page & (m.owner == victim))[0])
    lo = int(m.column[j]) * ps - int(b.starts[victim])
    keys = lo + slots % ps
    first, _ = read_range(b)
    seen = np.flatnonzero((keys >= first[victim] - b.starts[victim]) & (keys < b.seq_lens[victim]))
    t = int(seen[0]) if seen.size else 0  # the first write onto a key the victim reads
    key = int(keys[t])
    query = max(int(b.q_start[victim]), key)
    return Finding("shared-page-written", f"request {int(writers[t])} writes its position "
                   f"{int(positions[t])} to slot {int(slots[t])} on page {page}, which request {victim} reads as keys "
                   f"{max(lo, 0)}..{lo + ps - 1}: request {victim}'s key {key} is overwritten (page {page} is read by requests "
                   f"{', '.join(map(str, readers))})", request=victim, cell=(query, key))


def _writes(b) -> list[Finding]:
    """Each new token's slot is its own page's slot for its position."""
    if b.write_slots is None or not tokens_agree(b):
        return []
    ps = b.page_size
    n = int(b.q_indptr[-1])
    slots = b.write_slots[:n]
    token_req = np.repeat(np.arange(b.requests), b.q_lens)[: slots.size]
    index = np.arange(slots.size) - b.q_indptr[token_req]
    position = first_positions(b)[token_req] + index
    col = (b.starts[token_req] + position) // ps
    have = col < np.diff(b.page_indptr)[token_req]
    expected = np.full(slots.size, -1, np.int64)
    expected[have] = b.pages[b.page_indptr[token_req[have]] + col[have]] * ps + (b.starts[token_req] + position)[have] % ps
    t = first_true(have & (position >= 0) & (slots != expected))  # a position before 0 is the length rules' finding
    if t is None:
        return []
    r = int(token_req[t])
    page = int(slots[t]) // ps
    whose = "another request's page" if page in set(np.delete(b.pages, np.arange(b.page_indptr[r], b.page_indptr[r + 1])).tolist()) else "not its slot"
    return [Finding("slot-mapping", f"token {t} (request {r}, position {int(position[t])}) is written to slot {int(slots[t])} ({whose}); its "
                    f"{b.name('table')} puts position {int(position[t])} at slot {int(expected[t])}",
                    request=r, cell=(int(position[t]), int(position[t])))]


def batch_rules(check, *caught: tuple[str, str]) -> tuple[Rule, ...]:
    """The rules whose findings `check` makes from one batch's metadata, each (code, the bug it catches); all wrong."""
    return tuple(Rule(code, "wrong", "batch", catches, check, given="metadata") for code, catches in caught)


RULES = batch_rules(
    lengths,
    ("no-keys", "a request with queries and a key length of 0 (often only at batch > 1): its rows are empty, the "
                "kernel writes zeros or NaN there"),
    ("more-queries-than-keys", "a request with more new tokens than keys, which include the new tokens"),
    ("seq-len", "seq_len not computed + new: a prefix hit whose new queries never see the cached prefix, or query "
                "offsets built from full lengths"),
    ("query-count", "query offsets (query_start_loc, cu_seqlens_q) that count more tokens than q holds (the per-token "
                    "slot mapping)"),
) + batch_rules(
    pages,
    ("table-short", "a block-table row with fewer blocks than the request's keys need"),
    ("last-page-fill", "a last page's fill (kv_last_page_len) outside 1..page_size"),
    ("bad-page", "a block the keys need that is no page (a negative id): keys read from outside the cache"),
    ("null-page", "the null page where keys are read: anywhere on a full layer, inside the window on a sliding one"),
    ("page-twice", "one request reading one page as two logical blocks"),
    ("shared-page-partial", "a page shared between requests that is partly filled (prefix caching shares only full pages)"),
    ("shared-page-written", "a page another request reads, written this step (a page reused while a request, or its "
                            "sliding window, still reads it)"),
    ("slot-mapping", "a new token written off its own page's slot for its position (block tables indexed in the wrong "
                     "units, another request's page)"),
)
