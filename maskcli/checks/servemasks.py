"""The rules that find a wrong mask in how an engine shapes a serving batch: vLLM's cascade (a shared prefix pass,
then each request's suffix), its chunked-local virtual batches, and speculative draft trees (custom masks, a static
choice list, the positions each draft is rotated at). Each is a function of one batch (ServeBatch, taken as it comes)
that servecheck.py's `check` runs through the registry.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.serve import batch_rules, first_positions, first_true, tokens_agree
from maskcli.text import Finding


def cascade(b) -> list[Finding]:
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
    r = first_true(b.q_start < C - 1)
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


def local(b) -> list[Finding]:
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
    i = first_true((v.q_indptr[1:] > b.q_indptr[owner + 1]) | (p1 // C != p0 // C))
    if i is not None:
        return [Finding("local-crosses-chunk", f"virtual batch {i} holds "
                        f"request {int(owner[i])}'s queries {int(p0[i])}..{int(p1[i])}, across a chunk of {C} (or a request) "
                        f"boundary: each virtual batch is one request's one chunk", request=int(owner[i]), cell=(int(p1[i]), int(p1[i])))]
    chunk_start = p0 // C * C
    given_start = p1 + 1 - v.seq_lens[: len(n)]
    i = first_true(given_start != chunk_start)
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


def trees(b) -> list[Finding]:
    """Each draft node sees the prefix, its ancestors and itself, and sits at position prefix + depth."""
    out = []
    depth_at = {}
    named = b.choice_parents
    for r, cells in b.trees.items():
        if cells.shape[0] > cells.shape[1] + b.tree_prefix.get(r, 0):
            continue  # lengths() says so
        if named is not None and len(named) != cells.shape[0]:
            own = b.read_tree(r)
            depth_at[r] = own.depth  # its positions are judged by its own mask's tree
            # FlashInfer's custom_mask holds every request of the batch, a prefill's plain causal too; SGLang's and
            # TensorRT-LLM's hold only the verify requests', each of which must be the tree
            if b.engine == "flashinfer" and own.wrong is None and np.array_equal(own.parents, np.arange(len(own.parents)) - 1):
                continue
            out.append(Finding("tree-mask", f"request {r} verifies {cells.shape[0]} drafts; {b.choices_name} makes "
                               f"{len(named)} (the root and {len(named) - 1} paths)", request=r))
            continue
        tree = b.read_tree(r, named, b.tree_prefix.get(r, 0))
        depth_at[r] = tree.depth
        if tree.wrong is not None:
            node, key, held = tree.wrong
            q = tree.prefix + node
            draft = key - tree.prefix
            name = "" if named is None else f" ({b.choice_path(node)} in {b.choices_name})"
            if key < tree.prefix:
                what = f"does not see prefix key {key}"
            elif held:
                parent = f"its parent is {int(tree.parents[node])}" if named is None else \
                    f"draft {draft} is {b.choice_path(draft)}"
                what = f"sees draft {draft}, which is not its ancestor ({parent})"
            else:
                what = f"does not see draft {draft}, its ancestor"
            out.append(Finding("tree-mask", f"request {r}'s draft node {node}{name} {what}: a tree node sees the "
                               f"prefix, its ancestors and itself", request=r, cell=(q, key)))
    if b.positions is None or not tokens_agree(b):
        return out
    token_req = np.repeat(np.arange(b.requests), b.q_lens)
    n = min(token_req.size, b.positions.size)
    expected = first_positions(b)[token_req] + (np.arange(token_req.size) - b.q_indptr[token_req])
    for r, depth in depth_at.items():
        expected[b.q_indptr[r]:b.q_indptr[r + 1]] = first_positions(b)[r] + depth
    t = first_true(b.positions[:n] != expected[:n])
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


RULES = batch_rules(
    cascade,
    ("cascade-lengths", "cascade lengths (cu_prefix_query_lens, prefix_kv_lens, suffix_kv_lens) that do not split each "
                        "request's keys once"),
    ("cascade-partial-page", "a cascade's common prefix that is not whole pages"),
    ("cascade-sees-later", "a cascade's common prefix past a request's first new token: the prefix pass shows it later keys"),
    ("cascade-pages", "a request whose prefix blocks are not the pages the prefix pass reads"),
) + batch_rules(
    local,
    ("local-lengths", "chunked-local virtual batches that split other tokens than the batch's"),
    ("local-crosses-chunk", "a chunked-local virtual batch across a chunk or request boundary"),
    ("local-keys", "a chunked-local virtual batch that sees keys before its chunk or misses its start: together they "
                   "are not local(C)"),
    ("local-pages", "a chunked-local virtual batch's block table that is not its chunk's blocks"),
) + batch_rules(
    trees,
    ("tree-mask", "a draft-tree node that sees more or less than the prefix, its ancestors and itself"),
    ("positions", "a token whose position is not its mask's (prefix + depth in a draft tree)"),
)
