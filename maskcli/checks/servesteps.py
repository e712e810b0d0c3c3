"""One request across a sequence of steps (chunked prefill, prefix hits, decode): together they are one causal pass.

Which request is which across steps: by `request_ids` where every step holds it (TensorRT-LLM's metadata has it;
add it to a dump from another engine); else by the pages a request wrote, as a paged engine's metadata shows them
(vLLM's and SGLang's hold no request id, and reorder their batches): a request continues the one that last wrote
the page its latest keys before its first new token are on, at the same logical block. Where two requests hold that
page (a full page shared by a prefix hit) the one that starts where the earlier step ended is taken, and the other
is a new request on the cached prefix. A request that starts at position 0, or holds no page an earlier step wrote
at that block, is a new one. Without pages either (contiguous caches) requests are matched by their index, which
needs the same number of requests in every step. Each step's own rules run on it alone; these compare a request's
consecutive steps. A request that starts again on a page boundary at or before where it ended, reading its own
pages, is what a preempted request recomputing, or a new request on its cached prefix, looks like: not a finding.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.pagemap import page_map
from maskcli.checks.registry import Rule
from maskcli.checks.serve import first_positions
from maskcli.errors import MaskError
from maskcli.text import Finding


def _by_index(batches: list) -> list[list[int]]:
    count = batches[0].requests
    for k, b in enumerate(batches):
        if b.requests != count:
            raise MaskError(f"step {k + 1} has {b.requests} requests and step 1 {count}, and no page table says which is "
                            f"which: add request_ids to each step file to say which request is which")
    return [list(range(b.requests)) for b in batches]


def _by_pages(batches: list) -> list[list[int]]:
    """Per step, each request's track (a request followed across steps), matched by the pages tracks last wrote."""
    owner: dict[int, tuple[int, int]] = {}  # page -> (track, logical block) of its last writer
    ends: list[int] = []  # track -> the position after the last one it computed
    out = []
    for b in batches:
        ps, start = b.page_size, first_positions(b)
        candidate: dict[int, int] = {}  # request -> the track that wrote the page of its latest earlier keys
        for i in range(b.requests):
            row = b.request_pages(i)
            for block in range(min(-(-int(start[i]) // ps), row.size) - 1, -1, -1):  # from the latest block down
                page = int(row[block])
                if page == b.null_page:
                    continue
                held = owner.get(page)
                if held is not None and held[1] == block:
                    candidate[i] = held[0]
                    break
        tracks: list[int | None] = [None] * b.requests
        taken: set[int] = set()
        for follows_on in (True, False):  # the request that starts where the track ended first (a shared full page)
            for i, t in candidate.items():
                if tracks[i] is None and t not in taken and (int(start[i]) == ends[t]) == follows_on:
                    tracks[i] = t
                    taken.add(t)
        for i in range(b.requests):
            if tracks[i] is None:
                tracks[i] = len(ends)
                ends.append(0)
            t, end = tracks[i], int(start[i] + b.q_lens[i])
            row = b.request_pages(i)
            for block in range(int(start[i]) // ps, min(-(-end // ps), row.size)):  # the blocks it writes this step
                owner[int(row[block])] = (t, block)
            ends[t] = end
        out.append(tracks)
    return out


def steps(batches: list, labels: list[str] | None = None) -> list[Finding]:
    """Each request's steps follow on without a gap or an overlap, and read earlier steps' keys from the pages they
    were written to. `labels` names the steps in findings (step 1, step 2, ... where not given); a finding's `step`
    is the index in `batches` of the later of the two steps it compares."""
    labels = labels or [f"step {k + 1}" for k in range(len(batches))]
    out: list[Finding] = []
    if len({b.engine for b in batches}) > 1:
        raise MaskError(f"the step files name {len({b.engine for b in batches})} engines ({', '.join(b.engine for b in batches)}): give one engine's steps")
    if all(b.request_ids is not None for b in batches):
        ids = [b.request_ids.tolist() for b in batches]
    elif all(b.page_size and b.pages.size for b in batches):
        ids = _by_pages(batches)
    else:
        ids = _by_index(batches)
    last: dict[int, tuple[int, object, int]] = {}  # request id -> (step, batch, index)
    for k, b in enumerate(batches):
        start = first_positions(b)
        for index, rid in enumerate(ids[k]):  # once per request and step
            if rid in last:
                out += _follow(last[rid], (k, b, index), rid, start[index], labels)
            last[rid] = (k, b, index)
    return out


_MAPS: dict[int, tuple[object, object]] = {}


def _page_map(b):
    """The step's page map, made once for all its requests (the last few steps' are kept)."""
    if id(b) not in _MAPS or _MAPS[id(b)][0] is not b:
        if len(_MAPS) > 4:
            _MAPS.clear()
        _MAPS[id(b)] = (b, page_map(b))
    return _MAPS[id(b)][1]


def _follow(before, after, rid: int, start: int, labels: list[str]) -> list[Finding]:
    (k0, b0, i0), (k1, b1, i1) = before, after
    one, two = labels[k0], labels[k1]
    end = int(first_positions(b0)[i0] + b0.q_lens[i0])
    start, ps = int(start), b1.page_size
    named = rid if b1.request_ids is not None else i1  # a request is named as its step names it
    again = start < end and ps and ps == b0.page_size and start % ps == 0  # preempted and recomputed, or a new request
    if start != end and not again:
        lo, hi = (end, start - 1) if start > end else (start, end - 1)
        span = f"position {lo}" if lo == hi else f"positions {lo}..{hi}"
        how = f"skips {span}" if start > end else f"computes {span} again"
        return [Finding("steps-positions", f"request {named}'s {two} starts at "
                        f"position {start}, {one} ended at {end - 1}: it {how}, so the steps are not one pass",
                        request=named, cell=(start, min(start, end)), step=k1)]
    if not ps or ps != b0.page_size:
        return []
    blocks = -(-min(end, start, int(b0.seq_lens[i0])) // ps)  # the keys it had before this step
    m = _page_map(b1)
    at = slice(b1.page_indptr[i1], b1.page_indptr[i1] + blocks)
    now, then = b1.pages[at], b0.request_pages(i0)[:blocks]
    n = min(now.size, then.size)
    differ = (now[:n] != then[:n]) & m.read[at][:n] & ~m.null[at][:n]
    hit = np.flatnonzero(differ)
    if not hit.size:
        return []
    j = int(hit[0])
    return [Finding("steps-pages", f"request {named}'s {two} reads keys {j * ps}..{(j + 1) * ps - 1} "
                    f"from page {int(now[j])}, but {one} wrote them on page {int(then[j])}", request=named, cell=(start, j * ps), step=k1)]


RULES = (
    Rule("steps-positions", "wrong", "steps", "a request's steps (chunked prefill, prefix hits) that skip or repeat "
         "positions: not one pass", steps, given="request-steps"),
    Rule("steps-pages", "wrong", "steps", "a request's step that reads earlier keys from other pages than they were "
         "written to", steps, given="request-steps"),
)
