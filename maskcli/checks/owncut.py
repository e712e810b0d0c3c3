"""A causal window over fewer keys than its queries: the step's own keys were cut, so its first queries see none.

trace/windows.py records the window the program hands the kernel where it calls it (`window_handed`): flash-attn's
`window_size = (L, 0)`, FlashInfer's `window_left = L`. Such a window states that a query at position p sees the keys
p - L .. p: its own key always among them. A self-attention call holding fewer keys than real queries in a batch row
cannot hold every query's own key, and a kernel that aligns its causal mask bottom-right (flash-attn, with
seqlen_k < seqlen_q) gives the first queries no key at all (zero output) and the next fewer than the window. That is
a step's keys replaced by what a cache bounded to the window handed back, the prompt's own cut to its last L + 1
(fla-org/flash-linear-attention#183: `Attention.forward` with a sliding window took `Cache.update`'s `attn_state`,
already cut to `window_size` tokens, at a prefill longer than the window; the fix keeps the prompt's own keys while
the cache was empty).

Read per batch row on its real queries (the model call's stated padding where it states it for the queries, else every
query): quiet where each row holds at least as many keys as real queries, where a real query sees no key while its
row holds as many keys (fully-masked's, or padding's), where a window is two-sided (an encoder's band), and on a call
the program states another sequence's (its module's word, a memory argument: context.crossing) rather than one whose
only sign of crossing is its shape.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, first_cell, keep
from maskcli.checks.handed import _reach, _shown
from maskcli.checks.real import by_row, stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def own_keys_cut(run: Run) -> list:
    """(call, Finding) for the first call of each site whose causal window holds fewer keys than real queries, some
    real query seeing no key."""
    found, done = [], set()
    for call in [*run.calls, *run.cross]:  # (fewer queries than keys: engine.py reads it as crossing, by its shape)
        held = call.details.get("window_handed")
        if not held or len(held) != 4 or int(held[2]) != 0 or int(held[1]) < 0 or call.where in done:
            continue
        b_len, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if k_len >= q_len or call.stored is None or call.details.get("slots") is not None:
            continue  # (most calls: a prefill over its own keys, a decode step over its cache)
        read = crossing(call)
        if read.cross and read.by != "shape" or _split(run, call):
            continue
        cells = keep(call)
        if cells is None:
            continue
        rows = by_row(cells, b_len if cells.shape[0] in (1, b_len) else None)
        said = stated(run.top(call), rows.shape[0], q_len) if run.top(call) is not None else None
        real = said[0] if said is not None else np.ones((rows.shape[0], q_len), dtype=bool)
        blind = real & ~rows.any(axis=-1) & (real.sum(axis=1) > k_len)[:, None]
        if not blind.any():
            continue
        done.add(call.where)
        b, q = first_cell(blind)
        width = int(held[1]) + 1
        seen = rows[b].sum(axis=-1)
        few = int((real[b] & (seen > 0) & (seen < np.minimum(np.cumsum(real[b]), width))).sum())
        found.append((call, Finding("own-keys-cut", (
            f"{held[3]} holds {held[0]} = {_shown(held[0], int(held[1]), 0)}: a query at p sees keys "
            f"{_reach(int(held[1]), 0)}, its own among them; but the call (step {call.step}) holds {k_len} keys for the {int(real[b].sum())} real queries of "
            f"batch row {b}, and query {q} sees no key at all ({int(blind[b].sum())} such queries, {few} more see fewer "
            f"than their window): the step's own keys were cut, as a cache bounded to the window hands back"),
            expected=f"window({width}) over the step's own keys", source=str(held[3]), cell=(b, q, 0))))
    return found


def _split(run: Run, call) -> bool:
    """Whether the same queries attended their own keys in another call of the site within the same model call: a
    square call over as many queries and batch rows (sglang#26513's FlashInfer extend with a cached prefix: a ragged pass
    over the step's own keys, then a paged pass over the prefix's last window, merged by log-sum-exp; the second holds
    fewer keys than queries, the first holds their own)."""
    top = run.top(call)
    held = run.__dict__.get("_square_calls")
    if held is None or held[0] != len(run.calls):  # (read once a run: a site's square calls by model call, rows, queries)
        held = run.__dict__["_square_calls"] = (len(run.calls), {(one.where, id(run.top(one)), one.shape[0], one.shape[2])
                                                                 for one in run.calls if one.shape[2] == one.shape[3]})
    squares = held[1]
    return top is not None and (call.where, id(top), call.shape[0], call.shape[2]) in squares


RULES = (
    Rule("own-keys-cut", "wrong", "call", "a causal window (L, 0) handed to the kernel over fewer keys than its real "
         "queries, so the first queries see no key: the step's own keys replaced by a window-bounded cache's "
         "(flash-linear-attention#183)", own_keys_cut),
)
