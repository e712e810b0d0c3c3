"""A new batch's first attention pass shorter than an earlier batch's handed the same shapes: state left from before.

A model call that is handed tensors of the same shapes as an earlier call of the same module, and the same other
arguments (numbers, flags, functions, lists by their items: trace/handedshapes.py), states a new sequence of the same
length (a forecaster handed a second batch of series of one context length, a decoder a second prompt of one length). Where the first call of an attention site in each is a fresh pass (its keys are its own queries:
no cache behind it), the two passes must hold as many tokens: a later one that holds fewer, starting over from an
emptied cache, was handed only the tail of its input by state the first batch left set (lag-llama 5f0393d: reset_cache
cleared each block's K/V but left the model's `y_cache = True`, so the next batch fed only its last step and built its
cache from that one token, and every forecast of the new series attended 1 key instead of its 32-step context).

Read per batch row of the fresh pass: the tail rows it holds are the last of the earlier pass's rows, and the keys the
earlier pass shows those rows before the tail are what the later one misses. Quiet where the shapes differ (a decode
step, another length), where either pass reads a cache (keys beyond its queries), where the two calls state different
padding (a model that drops pads from its pass), where the batch rows differ, where the earlier call ran its site as
several fresh passes (one per packed segment, as a THD kernel's cu_seqlens cut them: their lengths are the data's,
not the shapes'), and where the shorter pass is neither a
single step nor followed by more steps of its site in the same call (a model that prunes tokens by their content runs
one pass of its own length).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

PADDING = ("attention_mask", "padding_mask", "key_padding_mask", "pad_mask", "input_mask", "mask", "lengths",
           "seq_lens", "seq_lengths", "input_lengths")


def _padding(top) -> dict:
    """{name: per-row real counts} of the padding the call states (a model whose pass drops pads runs what they leave)."""
    found = {}
    for name in PADDING:
        value = top.arguments.get(name)
        if isinstance(value, np.ndarray) and value.size:
            found[name] = value.reshape(value.shape[0], -1).astype(np.int64).sum(axis=1).tolist()
    return found


def _firsts(run: Run, top) -> dict:
    """{site: (its first call in `top`, how many calls the site makes in it, how many of them are fresh passes)}."""
    found: dict = {}
    for call in run.made_by(top):
        held = found.get(call.where) or (call, 0, 0)
        found[call.where] = (held[0], held[1] + 1, held[2] + _fresh(call))
    return found


def _fresh(call) -> bool:
    """Its keys are its own queries: no cache, nothing from an earlier call. Not one query per head scored against keys
    gathered for it (trace/headquery.py): as many keys as queries there says only how many it gathered (a reference
    loop over each query's allowed keys, a paged decode), not that they are its own."""
    return call.shape[2] == call.shape[3] and call.shape[2] > 0 and "head_query" not in call.details


def restarted(run: Run) -> list:
    """The first fresh pass of each site of a later model call that holds fewer tokens than an earlier call's handed the
    same shapes."""
    found, earlier = [], {}
    for top in run.tops:
        shapes = top.shapes  # (trace/handedshapes.py)
        if not shapes:
            continue
        key = (top.where, shapes)
        firsts = _firsts(run, top)
        before = earlier.get(key)
        if before is None:
            earlier[key] = (top, firsts, _padding(top))
            continue
        first_top, first_calls, padding = before
        if _padding(top) != padding:
            continue
        for where, (call, count, _) in sorted(firsts.items(), key=lambda item: item[1][0].index):
            then = first_calls.get(where)
            if then is None or then[2] > 1:  # the earlier ran one pass per packed segment: their lengths are the data's
                continue
            one = then[0]
            n, m = call.shape[2], one.shape[2]
            if not (_fresh(call) and _fresh(one)) or n >= m or call.shape[0] != one.shape[0] or (n > 1 and count < 2):
                continue
            cells = keep(one)
            if cells is None:
                continue
            seen = cells.any(axis=1)[:, m - n:, :m - n]  # (b, n, m - n): the earlier pass's keys before the tail rows
            if not seen.any():
                continue
            b, j, k = (int(x) for x in np.argwhere(seen)[0])
            named = ", ".join(f"{name} {shape}" for name, shape in shapes if isinstance(shape, tuple) and len(shape) >= 2)
            found.append((call, Finding("restarted-from-tail", (
                f"batch row {b}: this model call's first pass at the site holds {n} token{'s' if n != 1 else ''} over "
                f"{n} key{'s' if n != 1 else ''} (no cache behind it), where the earlier call of {top.where} handed the "
                f"same shapes ({named}) ran {m}: its query {j} misses the {int(seen[b, j].sum())} keys before the "
                f"tail that pass shows its row {m - n + j} (key {k} first): the new batch was fed only its last "
                f"{'step' if n == 1 else f'{n} steps'}, as if it continued the one before (a cache flag left set "
                f"by a reset that cleared the keys?)"),
                expected=f"{m} tokens, as the first pass of the call handed the same shapes",
                source=f"{first_top.where}'s earlier call handed {named}", cell=(b, m - n + j, k))))
            break
    return found


RULES = (
    Rule("restarted-from-tail", "wrong", "steps", "a model call handed the same shapes as an earlier one whose first "
         "fresh attention pass (no cache behind it) holds fewer tokens: the new batch fed only its tail, as if it "
         "continued the last (a cache flag a reset left set)", restarted),
)
