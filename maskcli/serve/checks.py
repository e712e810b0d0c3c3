"""The rules that find a wrong serving batch: each a small function of a ServeBatch returning Findings.

A finding names the request and the first wrong cell (query position, key position), absolute,
where one exists. Rules are vectorised over requests and pages: O(requests + pages + tokens).
They stay quiet on what engines do on purpose: null blocks out of a sliding window, full
pages shared by prefix caching, padding slots (-1) after the batch's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from maskcli import text
from maskcli.checks.registry import severity
from maskcli.serve.batch import ServeBatch, cumulative
from maskcli.serve.pagemap import distinct, page_map, read_range


@dataclass(frozen=True)
class Finding(text.Finding):
    """A finding about a serving batch: a maskcli.text.Finding (its rule in maskcli/checks/serve.py gives its severity
    where it states none) that names its request; `cell` is (query position, key position), absolute, in that request."""

    request: int | None = None

    def json(self) -> dict:
        return {"code": self.code, "severity": severity(self), "request": self.request,
                "cell": None if self.cell is None else list(self.cell), "message": self.message}


def _first(bad: np.ndarray) -> int | None:
    hit = np.flatnonzero(bad)
    return int(hit[0]) if hit.size else None


def _tokens_agree(b: ServeBatch) -> bool:
    """The query offsets split q's tokens as q holds them (else per-token rules would blame the wrong request)."""
    return b.tokens is None or int(b.q_indptr[-1]) == b.tokens


def first_positions(b: ServeBatch) -> np.ndarray:
    """Each request's first new token's position: as the cache says where it says, else as the kernel aligns it."""
    return b.computed if b.computed is not None else b.q_start


def lengths(b: ServeBatch) -> list[Finding]:
    """seq_len = computed + new; the query count is the new tokens q holds; no request with queries and no keys."""
    out = []
    q_lens, seq = b.q_lens, b.seq_lens
    keyless = (q_lens > 0) & (seq == 0)
    r = _first(keyless)
    if r is not None:
        out.append(Finding("no-keys", f"request {r} has {int(q_lens[r])} {'query' if q_lens[r] == 1 else 'queries'} and 0 keys ({b.name('seq_lens')} "
                           f"is 0): its rows are empty, the kernel writes zeros or NaN there", request=r))
    r = _first((q_lens > seq) & (seq > 0))
    if r is not None:
        out.append(Finding("more-queries-than-keys", f"request {r} has {int(q_lens[r])} new tokens but {int(seq[r])} keys: "
                           f"the keys include the new tokens, so {b.name('seq_lens')} must be at least {b.name('queries')}'s count", request=r))
    counted = b.tokens is not None and int(b.q_indptr[-1]) != b.tokens
    said_count = (f"{b.name('queries')} counts {int(b.q_indptr[-1])} query tokens but {b.name('writes')} has {b.tokens}"
                  if counted else "")
    if b.computed is not None:
        bad = (b.computed + q_lens != seq) & ~keyless  # a request with no keys is no-keys' finding, once
        r = _first(bad)
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


def pages(b: ServeBatch) -> list[Finding]:
    """The page table covers exactly the keys; no null page where keys are read; shared pages full and unwritten."""
    if b.page_size == 0:
        return []
    out = []
    ps = b.page_size
    if b.short_table is not None and b.short_table.any():
        r = _first(b.short_table)
        out.append(Finding("table-short", f"request {r}'s {b.name('table')} row has fewer blocks than its "
                           f"{int(b.seq_lens[r])} keys need ({-(-int(b.starts[r] + b.seq_lens[r]) // ps)} of {ps} tokens)", request=r))
    if b.last_fill is not None:
        counts = np.diff(b.page_indptr)
        bad = (counts > 0) & ((b.last_fill < 1) | (b.last_fill > ps))
        r = _first(bad)
        if r is not None:
            out.append(Finding("last-page-fill", f"request {r}'s {b.name('last')} is {int(b.last_fill[r])}: a last "
                               f"page holds 1 to {ps} tokens (page_size {ps})", request=r))
    m = page_map(b)
    owner, column = m.owner, m.column
    first, _ = read_range(b)
    i = _first(m.read & (b.pages < 0))
    if i is not None:
        r = int(owner[i])
        out.append(Finding("bad-page", f"request {r}'s logical block {int(column[i])} is page {int(b.pages[i])}, "
                           f"which is no page: the keys there are read from outside the cache", request=r))
    i = _first(m.read & m.null)
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


def _shared(b: ServeBatch, m) -> list[Finding]:
    out = []
    ps = b.page_size
    real = m.read & ~m.null
    owner, column = m.owner, m.column
    key = b.pages[real] * max(b.requests, 1) + owner[real]
    if distinct(key).size < key.size:  # one request listing one page at two logical blocks
        order = np.lexsort((column[real], owner[real], b.pages[real]))
        p, o, c = b.pages[real][order], owner[real][order], column[real][order]
        i = _first((p[1:] == p[:-1]) & (o[1:] == o[:-1]))
        out.append(Finding("page-twice", f"request {int(o[i])} reads page {int(p[i])} as logical blocks "
                           f"{int(c[i])} and {int(c[i + 1])}: two blocks of keys cannot live on one page", request=int(o[i])))
    i = _first(m.shared & (m.fill < ps))
    if i is not None:
        r, page = int(owner[i]), int(b.pages[i])
        others = sorted(set(owner[m.shared & (b.pages == page)].tolist()) - {r})
        out.append(Finding("shared-page-partial", f"page {page} is shared by requests {r} and {others[0]}, but it is "
                           f"request {r}'s partly filled last block ({int(m.fill[i])} of {ps}): only full pages are shared, a "
                           f"partial one is still being written", request=r))
    i = _first(m.shared & m.written)
    if i is not None:
        out.append(_shared_written(b, m, int(b.pages[i])))
    return out


def _writers(b: ServeBatch, m, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    column = np.repeat(lo, count) + np.arange(int(count.sum())) - np.repeat(cumulative(count)[:-1], count)
    return r, column - b.starts[r], page * ps + column % ps


def _shared_written(b: ServeBatch, m, page: int) -> Finding:
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


def _writes(b: ServeBatch) -> list[Finding]:
    """Each new token's slot is its own page's slot for its position."""
    if b.write_slots is None or not _tokens_agree(b):
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
    t = _first(have & (position >= 0) & (slots != expected))  # a position before 0 is the length rules' finding
    if t is None:
        return []
    r = int(token_req[t])
    page = int(slots[t]) // ps
    whose = "another request's page" if page in set(np.delete(b.pages, np.arange(b.page_indptr[r], b.page_indptr[r + 1])).tolist()) else "not its slot"
    return [Finding("slot-mapping", f"token {t} (request {r}, position {int(position[t])}) is written to slot {int(slots[t])} ({whose}); its "
                    f"{b.name('table')} puts position {int(position[t])} at slot {int(expected[t])}",
                    request=r, cell=(int(position[t]), int(position[t])))]


def cascade(b: ServeBatch) -> list[Finding]:
    """vLLM's cascade (every query sees the shared prefix, then its own suffix causally) equals plain attention."""
    c = b.cascade
    if c is None:
        return []
    out = []
    C, ps = c.prefix_len, b.page_size
    total = int(b.q_indptr[-1])
    for name, got, want in (("cu_prefix_query_lens", c.prefix_query, [0, total]), ("prefix_kv_lens", c.prefix_kv, [C]),
                            ("suffix_kv_lens", c.suffix_kv, (b.seq_lens - C).tolist())):
        if got is not None and got.tolist() != list(want):
            out.append(Finding("cascade-lengths", f"{name} is {got[:6].tolist()}, cascade with common_prefix_len "
                               f"{C} needs {list(want)[:6]}: the prefix and suffix passes would not cover each request's keys once"))
    if ps and C % ps:
        out.append(Finding("cascade-partial-page", f"common_prefix_len {C} is not whole pages of {ps}: the prefix "
                           f"pass reads pages, so vLLM rounds it down to a multiple of block_size"))
    r = _first(b.q_start < C - 1)
    if r is not None:
        q = int(max(b.q_start[r], 0))
        out.append(Finding("cascade-sees-later", f"request {r}'s query at position {q} sees key {q + 1} of the "
                           f"shared prefix (0..{C - 1}), which the prefix pass shows every query without a causal mask: the "
                           f"common prefix must end before each request's first new token", request=r, cell=(q, q + 1)))
    if ps and b.requests > 1:
        blocks = -(-C // ps)
        lead = b.request_pages(0)[:blocks]
        for r in range(1, b.requests):  # one comparison of `blocks` pages per request
            own = b.request_pages(r)[:blocks]
            if own.size == lead.size and not np.array_equal(own, lead):
                j = int(np.flatnonzero(own != lead)[0])
                out.append(Finding("cascade-pages", f"the prefix pass reads request 0's "
                                   f"pages; request {r}'s logical block {j} is page {int(own[j])}, not {int(lead[j])}: its keys "
                                   f"{j * ps}..{min((j + 1) * ps, C) - 1} are another request's", request=r, cell=(int(b.q_start[r]), j * ps)))
                break
    return out


def local(b: ServeBatch) -> list[Finding]:
    """vLLM's chunked-local virtual batches (one per request and chunk, each bottom-right causal over its chunk's keys
    so far, reading the chunk's own blocks) together equal local(C) over the real batch."""
    v = b.local
    if v is None or b.chunk is None:
        return []
    C, ps = b.chunk, b.page_size
    if int(v.q_indptr[-1]) != int(b.q_indptr[-1]):
        return [Finding("local-lengths", f"local_query_start_loc counts {int(v.q_indptr[-1])} query tokens, "
                        f"query_start_loc {int(b.q_indptr[-1])}: the virtual batches must split the same tokens")]
    first = v.q_indptr[:-1]
    owner = np.searchsorted(b.q_indptr, first, side="right") - 1
    n = np.diff(v.q_indptr)
    p0 = b.q_start[owner] + first - b.q_indptr[owner]
    p1 = p0 + n - 1
    i = _first((v.q_indptr[1:] > b.q_indptr[owner + 1]) | (p1 // C != p0 // C))
    if i is not None:
        return [Finding("local-crosses-chunk", f"virtual batch {i} holds "
                        f"request {int(owner[i])}'s queries {int(p0[i])}..{int(p1[i])}, across a chunk of {C} (or a request) "
                        f"boundary: each virtual batch is one request's one chunk", request=int(owner[i]), cell=(int(p1[i]), int(p1[i])))]
    chunk_start = p0 // C * C
    given_start = p1 + 1 - v.seq_lens[: len(n)]
    i = _first(given_start != chunk_start)
    if i is not None:
        r, q = int(owner[i]), int(p0[i])
        cell = (q, int(given_start[i])) if given_start[i] < chunk_start[i] else (q, int(chunk_start[i]))
        how = "sees keys before its chunk" if given_start[i] < chunk_start[i] else "misses the start of its chunk"
        return [Finding("local-keys", f"virtual batch {i} (request {r}, queries {q}..{int(p1[i])}) has "
                        f"local_seqused_k {int(v.seq_lens[i])}, so it {how} {int(chunk_start[i])}..: local({C}) needs "
                        f"{int(p1[i] + 1 - chunk_start[i])}", request=r, cell=cell)]
    out = []
    if ps and v.tables.size:
        for i in range(len(n)):  # one comparison of a chunk's blocks per virtual batch
            r, lo = int(owner[i]), int(b.starts[owner[i]] + chunk_start[i]) // ps
            blocks = -(-int(v.seq_lens[i]) // ps)
            want, got = b.request_pages(r)[lo:lo + blocks], v.tables[i, :blocks]
            if want.size == got.size and not np.array_equal(want, got):
                j = int(np.flatnonzero(want != got)[0])
                key = int(chunk_start[i]) + j * ps
                out.append(Finding("local-pages", f"virtual batch {i}'s block {j} is page "
                                   f"{int(got[j])}, but request {r}'s keys {key}.. are on page {int(want[j])}", request=r, cell=(int(p0[i]), key)))
                break
    return out


def _first_seen(mask, row: int) -> int | None:
    """The first key a query row of a request's mask sees, from its intervals (a row of a tree 10^9 keys behind its
    cache is not made into 10^9 cells); None where it sees none."""
    from maskcli.intervals import NotFew

    try:
        found = mask.intervals()
    except NotFew:
        seen = np.flatnonzero(mask.cells(0, 0, row, row + 1)[0])
        return int(seen[0]) if seen.size else None
    starts, ends = found.starts[0, min(row, found.starts.shape[1] - 1)], found.ends[0, min(row, found.ends.shape[1] - 1)]
    live = starts < ends
    return int(starts[live].min()) - found.k_start if live.any() else None


def trees(b: ServeBatch) -> list[Finding]:
    """Each draft node sees the prefix, its ancestors and itself, and sits at position prefix + depth."""
    from maskcli.serve.trees import read_tree

    from maskcli.serve import choices

    out = []
    depth_at = {}
    named = choices.parents(list(b.choices)) if b.choices else None
    for r, cells in b.trees.items():
        if cells.shape[0] > cells.shape[1] + b.tree_prefix.get(r, 0):
            continue  # lengths() says so
        if named is not None and len(named) != cells.shape[0]:
            own = read_tree(cells)
            depth_at[r] = own.depth  # its positions are judged by its own mask's tree
            # FlashInfer's custom_mask holds every request of the batch, a prefill's plain causal too; SGLang's and
            # TensorRT-LLM's hold only the verify requests', each of which must be the tree
            if b.engine == "flashinfer" and own.wrong is None and np.array_equal(own.parents, np.arange(len(own.parents)) - 1):
                continue
            out.append(Finding("tree-mask", f"request {r} verifies {cells.shape[0]} drafts; {b.choices_name} makes "
                               f"{len(named)} (the root and {len(named) - 1} paths)", request=r))
            continue
        tree = read_tree(cells, named, b.tree_prefix.get(r, 0))
        depth_at[r] = tree.depth
        if tree.wrong is not None:
            node, key, held = tree.wrong
            q = tree.prefix + node
            draft = key - tree.prefix
            name = "" if named is None else f" ({choices.path_of(list(b.choices), node)} in {b.choices_name})"
            if key < tree.prefix:
                what = f"does not see prefix key {key}"
            elif held:
                parent = f"its parent is {int(tree.parents[node])}" if named is None else \
                    f"draft {draft} is {choices.path_of(list(b.choices), draft)}"
                what = f"sees draft {draft}, which is not its ancestor ({parent})"
            else:
                what = f"does not see draft {draft}, its ancestor"
            out.append(Finding("tree-mask", f"request {r}'s draft node {node}{name} {what}: a tree node sees the "
                               f"prefix, its ancestors and itself", request=r, cell=(q, key)))
    if b.positions is None or not _tokens_agree(b):
        return out
    token_req = np.repeat(np.arange(b.requests), b.q_lens)
    n = min(token_req.size, b.positions.size)
    expected = first_positions(b)[token_req] + (np.arange(token_req.size) - b.q_indptr[token_req])
    for r, depth in depth_at.items():
        expected[b.q_indptr[r]:b.q_indptr[r + 1]] = first_positions(b)[r] + depth
    t = _first(b.positions[:n] != expected[:n])
    if t is not None:
        r = int(token_req[t])
        role = f"draft node {t - int(b.q_indptr[r])} at depth {int(depth_at[r][t - b.q_indptr[r]])}" if r in depth_at else f"new token {t - int(b.q_indptr[r])}"
        row = t - int(b.q_indptr[r])
        mask = b.mask(r)
        first = _first_seen(mask, row) if mask is not None else None
        # the token's row (as the kernel aligns it) and the first key it sees: every key's distance to it is off
        cell = (int(b.q_start[r]) + row, first) if first is not None else None
        out.append(Finding("positions", f"token {t} (request {r}'s {role}) has "
                           f"position {int(b.positions[t])}; its mask puts it at {int(expected[t])}"
                           f"{' (prefix + depth)' if r in depth_at else ''}: RoPE would rotate it as another token", request=r, cell=cell))
    return out


RULES = (lengths, pages, cascade, local, trees)


def check(b: ServeBatch) -> list[Finding]:
    out = []
    for rule in RULES:
        out += rule(b)
    return [_inside(b, f) for f in out]


def _inside(b: ServeBatch, f: Finding) -> Finding:
    """The finding, without its cell where that cell is no cell of its request (a position before 0, or past its last
    key as the kernel or the cache counts them): a finding names only cells a mask of that request has."""
    if f.cell is None or f.request is None or not 0 <= f.request < b.requests:
        return f
    r = f.request
    keys = max(int(b.seq_lens[r]), int(b.computed[r] + b.q_lens[r]) if b.computed is not None else 0)
    if all(0 <= int(x) < keys for x in f.cell):
        return f
    return replace(f, cell=None)
