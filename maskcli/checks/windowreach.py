"""A sliding layer that keeps its stated window on some real queries and lets others see past it.

A config states the window of a sliding layer (`sliding_window` with `layer_types`, a pattern, or alone:
checks/intent.py, wherever the program keeps it), and the layer's mask holds that window for some real queries
(each sees no real key W or more positions back, where such keys exist) while another real query of the same mask
sees a real key further back than either count of the window allows (W + 1 positions or more: past W keys with the
query and past W keys before it). The window was laid and then undone for part of the queries: something OR-ed on
top of the window instead of inside it (transformers#46850: Gemma 3's bidirectional image block OR-ed after the
sliding window, so an image token saw the whole image however far back; the fix is AND(window, OR(causal, block))).

Read per batch row on the real queries and keys only and at each query's own position (checks/config.py's placing:
the model call's attention_mask, else the padding read off the mask, cache offsets resolved), so a left-padded row or
a decode step is read as an unpadded prefill is. Left to config.py: a mask with no window at all (causal or full:
window-missing), a window one key off, a window kept on one side only (window-half-missing); a config that states the
attention both ways (a band, not a window behind the query); a mask where a real query does not see the key at its own
position (packed requests over a paged cache: the keys are not laid by position there). Later keys a sliding layer's image block lets a query
see are not read here: the fix keeps them (transformers' sliding overlay bounds the keys behind a query only).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def window_reach(run: Run) -> list:
    """Calls of a sliding layer whose window bounds some real queries and not another, that sees past it."""
    from maskcli.checks.config import _each_layer_call, _half, _layer  # (config.py holds the placing, at its limit)

    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None or stated.bidirectional():
            continue
        size, name = stated.window()
        if placed.holds("causal") or placed.holds("full") or any(
                placed.holds(f"window({w})") for w in (size - 1, size, size + 1) if w >= 1) or _half(placed, size):
            continue  # (config.py's: no window, or one key off, or one side only)
        own = placed.own.astype(np.int64)
        if own.min(initial=0) < 0 or own.max(initial=0) >= placed.seen.shape[-1] or (
                placed.judged.any(axis=-1) & ~placed.seen[..., np.arange(own.size), own]).any():
            continue  # (a real query that does not see its own position: its keys are not laid by position there, as
            # a paged cache's packed requests are not)
        back = placed.own[:, None] - placed.keys[None, :]  # (Lq, Lk): how far behind each query each key sits
        beyond = (back > size)[None, None] & placed.judged  # real keys past either count of the window
        seen = np.broadcast_to(placed.seen, beyond.shape) & beyond
        reaching = beyond.any(axis=-1)  # (B, 1, Lq): real queries with a real key past the window to see
        every = np.broadcast_to(placed.seen, beyond.shape)
        slid = np.zeros(beyond.shape[:-1], dtype=bool)  # (B, 1, Lq): the query before it saw a key it does not
        slid[..., 1:] = (every[..., :-1, :] & ~every[..., 1:, :]).any(axis=-1)
        inside = ((back >= 0) & (back < size))[None, None] & placed.judged  # real keys within the window behind it
        full = ~(inside & ~every).any(axis=-1)  # ... every one of them seen
        kept = reaching & ~seen.any(axis=-1) & full & slid  # ... none past it, all within, sliding on: the window holds
        # (a query whose keys start at a packed document's first token keeps to its document, not to a window: it misses
        # keys within the window, or the query before it dropped none. torchtitan's full layer over packed documents)
        if not kept.any() or not seen.any():
            continue
        b, _, q, k = (int(x) for x in np.argwhere(seen)[0])
        kb, _, kq = (int(x) for x in np.argwhere(kept)[0])
        source = stated.said(name)
        sure = "sliding_window" in name
        found.append((call, Finding("window-escaped", (
            f"batch row {b}: query {int(placed.own[q])} of {_layer(index, call)}, a sliding layer ({kind[1]}), sees key "
            f"{k}, {int(placed.own[q]) - k} positions back, past the window({size}) its config states ({source}), "
            f"while query {int(placed.own[kq])} of batch row {kb} keeps to it ({int(seen.sum())} such cells): "
            "something was OR-ed on top of the window instead of inside it (an image block, a prefix?)"
            + ("" if sure else ", unless its window_size is not the attention's")),
            severity=None if sure else "suspicious", expected=f"window({size}) on every query", source=source,
            cell=(b, int(placed.own[q]), k))))
    return found


RULES = (
    Rule("window-escaped", "wrong", "steps", "a sliding layer whose stated window bounds some real queries while another "
         "sees a key further back than it (an image block or prefix OR-ed after the window, not inside it: "
         "transformers#46850)", window_reach),
)
