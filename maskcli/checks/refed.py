"""A cached step handed again the tokens its cache already holds: each step's keys hold the same tokens twice.

A model call's token ids (input_ids, idx, tokens, inputs, a hand-written forward's first argument, or ids read off
its embeddings: trace/tops.py) say which tokens it feeds; an attention site's keys over a cache are the cache's, then
the call's own. Where the next call of the same module begins with every token the call before it was handed (the
same prompt again, or the whole sequence so far) and the site's keys grew by all of the new call's tokens (the keys
of the call before, nothing evicted, then its own), the earlier call's tokens are in the cache and fed again: the
cache holds them twice, and a query sees its own token's earlier copy beside itself. A decode loop meant to feed the
new token alone when a cache exists (lucidrains/infini-transformer-pytorch c42031f: generate() handed the prompt back
at every step while the kv cache kept growing, so the queries attended to repeated copies of the prompt and never to
the sampled tokens; the fix feeds `x[:, -1:]` once a cache exists).

Wrong where it happens at two steps in a row of one batch row (three calls: a loop, not one chunk of a text that
repeats), the earlier ids hold two tokens or more of at least two distinct ids (one token fed again is a decode that
sampled the same token; a run of one id is filler), and the query sees both copies. Read per batch row on the first
call of each site in each model call; quiet where the keys did not grow by the call's tokens (a cache reset, a prefix
cache copied per request, a window that evicts), where the ids differ, and on cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import handed_ids
from maskcli.checks.registry import Rule
from maskcli.text import Finding

IDS = ("input_ids", "idx", "tokens", "inputs")


def _ids(top) -> tuple[str, np.ndarray] | None:
    """(its name, int64 (B, L)) of the token ids a model call was handed; None where it states none."""
    arguments = top.arguments
    found = handed_ids(arguments, IDS)
    if found is not None and found[1].size:
        return found
    given = arguments.get("embeds_ids")
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.size:
        return "inputs_embeds (one id per vector)", given
    return None


def _firsts(run: Run, top) -> dict:
    """{site: its first call in `top`}."""
    found: dict = {}
    for call in run.made_by(top):
        found.setdefault(call.where, call)
    return found


def _refed(before: np.ndarray, after: np.ndarray, one, call) -> dict:
    """{batch row: (query, key of its token's cached copy, its own key)} of each row whose `after` ids begin with all of
    its `before` ids, fed again over a cache that holds them: the site's keys grew by all of `after`'s tokens."""
    batch, _, q_len, k_len = call.shape
    m = before.shape[1]
    if one.shape[0] != batch or before.shape[0] != batch or after.shape[0] != batch or q_len != after.shape[1] \
            or one.shape[2] != m or k_len != one.shape[3] + q_len or k_len <= q_len or m < 2 or q_len < m:
        return {}
    rows = (after[:, :m] == before).all(axis=1) & (before != before[:, :1]).any(axis=1)
    if not rows.any():
        return {}
    cells = keep(call)
    if cells is None:
        return {}
    seen = np.broadcast_to(cells.any(axis=1), (batch, q_len, k_len))
    start, own = one.shape[3] - m, one.shape[3]  # (the earlier call's tokens: the last m keys it had; now its own)
    j = np.arange(m)
    both = seen[:, j, start + j] & seen[:, j, own + j]  # (B, m): a query that sees its token's copy and itself
    found = {}
    for b in np.flatnonzero(rows & both.any(axis=1)).tolist():
        q = int(np.argmax(both[b]))
        found[b] = (q, start + q, own + q)
    return found


def check(run: Run) -> list:
    """Each module's model calls in order, each against the one before: a step fed again what its cache holds."""
    found, modules = [], {}
    for top in run.tops:
        if top.end > top.first:
            modules.setdefault(top.where, []).append(top)
    for where, tops in modules.items():
        last: dict = {}  # site -> (earlier call, call, {row: hit}) of the pair before
        said = False  # (once per module: the first step of the first streak)
        for before, after in zip(tops, tops[1:]):
            if said:
                break
            ids_before, ids_after = _ids(before), _ids(after)
            if ids_before is None or ids_after is None or ids_before[0] != ids_after[0]:
                last = {}
                continue
            then, now, hits = _firsts(run, before), _firsts(run, after), {}
            for site, call in now.items():
                one = then.get(site)
                if one is not None:
                    hits[site] = (one, call, _refed(ids_before[1], ids_after[1], one, call))
            for site, (one, call, rows) in sorted(hits.items(), key=lambda item: item[1][1].index):
                earlier = last.get(site)
                if earlier is None:
                    continue
                first_one, first_call, first_rows = earlier
                shared = [b for b in first_rows if b in rows]
                if not shared:
                    continue
                b = shared[0]
                q, copy, own = first_rows[b]
                m, n = first_one.shape[2], first_call.shape[2]
                name = ids_after[0]
                found.append((first_call, Finding("cache-fed-again", (
                    f"batch row {b}: this step's {n} tokens ({name} of {where}) begin with all {m} tokens the model call "
                    f"before it was handed, and its keys grew by all {n} ({first_one.shape[3]} -> "
                    f"{first_call.shape[3]}): the cache holds those tokens twice, and query {q} sees its own token's "
                    f"cached copy at key {copy} beside itself at key {own}; the next step fed them again too (the "
                    f"loop hands the prompt back at every step instead of the new token alone once a cache exists?)"),
                    expected=f"keys 0..{first_one.shape[3] - 1} from the cache, then the step's new tokens alone",
                    source=f"{name} of {where}'s calls, each beginning with the one before's",
                    cell=(b, q, copy))))
                said = True
                break
            last = {site: hit for site, hit in hits.items() if hit[2]}
    return found


RULES = (
    Rule("cache-fed-again", "wrong", "steps", "a cached step handed again the tokens its cache already holds (its ids "
         "begin with all of the call before's and its keys grew by all of them, two steps in a row): the cache holds "
         "them twice and the queries see both copies (a decode loop that feeds the prompt back at every step)", check),
)
