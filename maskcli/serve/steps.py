"""One request across a sequence of steps (chunked prefill, prefix hits): together they are one causal pass.

Requests are matched across step files by `request_ids` where the files hold it (TensorRT-LLM's
metadata has it; add it to a dump from another engine), else by their index, which needs the same
number of requests in every step. Each step's own rules run on it alone; these compare neighbours.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch
from maskcli.serve.checks import Finding, first_positions
from maskcli.serve.pagemap import page_map


def _ids(b: ServeBatch, step: int, count: int) -> list[int]:
    if b.request_ids is not None:
        return b.request_ids.tolist()
    if b.requests != count:
        raise MaskError(f"step {step + 1} has {b.requests} requests and step 1 {count}: add request_ids to each step file "
                        f"to say which request is which")
    return list(range(b.requests))


def steps(batches: list[ServeBatch]) -> list[Finding]:
    """Each request's steps follow on without a gap or an overlap, and read earlier steps' keys from the pages they were written to."""
    out: list[Finding] = []
    if len({b.engine for b in batches}) > 1:
        raise MaskError(f"the step files name {len({b.engine for b in batches})} engines ({', '.join(b.engine for b in batches)}): give one engine's steps")
    count = batches[0].requests
    last: dict[int, tuple[int, ServeBatch, int]] = {}  # request id -> (step, batch, index)
    for k, b in enumerate(batches):
        ids = _ids(b, k, count)
        start = first_positions(b)
        for index, rid in enumerate(ids):  # once per request and step
            if rid in last:
                out += _follow(last[rid], (k, b, index), rid, start[index])
            last[rid] = (k, b, index)
    return out


def _follow(before, after, rid: int, start: int) -> list[Finding]:
    (k0, b0, i0), (k1, b1, i1) = before, after
    end = int(first_positions(b0)[i0] + b0.q_lens[i0])
    if start != end:
        lo, hi = (end, int(start) - 1) if start > end else (int(start), end - 1)
        span = f"position {lo}" if lo == hi else f"positions {lo}..{hi}"
        how = f"skips {span}" if start > end else f"computes {span} again"
        return [Finding("steps-positions", f"request {rid}'s step {k1 + 1} starts at "
                        f"position {int(start)}, step {k0 + 1} ended at {end - 1}: it {how}, so the steps are not one pass",
                        request=rid, cell=(int(start), int(min(start, end))))]
    ps = b1.page_size
    if not ps or ps != b0.page_size:
        return []
    blocks = -(-min(end, int(b0.seq_lens[i0])) // ps)
    m = page_map(b1)
    at = slice(b1.page_indptr[i1], b1.page_indptr[i1] + blocks)
    now, then = b1.pages[at], b0.request_pages(i0)[:blocks]
    n = min(now.size, then.size)
    differ = (now[:n] != then[:n]) & m.read[at][:n] & ~m.null[at][:n]
    hit = np.flatnonzero(differ)
    if not hit.size:
        return []
    j = int(hit[0])
    return [Finding("steps-pages", f"request {rid}'s step {k1 + 1} reads keys {j * ps}..{(j + 1) * ps - 1} "
                    f"from page {int(now[j])}, but step {k0 + 1} wrote them on page {int(then[j])}", request=rid, cell=(int(start), j * ps))]
