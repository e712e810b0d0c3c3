"""A decode step placed past every key it is handed: the keys before it, which its own prefill attended, never reached it.

A call site's first pass over a sequence (its queries at positions 0 .. L - 1, as many keys, L two or more) where some
query sees a key before its own shows the layer attends back over the sequence; so does a step behind its cache that
sees keys before its own (a prompt fed token by token: aprender's self-speculative decode). A later call of the same site handed
as many keys as queries, whose queries the model call places past all of them (its position_ids, cache_position or
start position: checks/placing.py; query p with only q keys, p >= q), and fewer keys than that first pass had, is
handed none of the keys the first pass let the same layer read: the cache the step continues is not what the kernel
got (bigcode Megatron-LM f1a50a3: FlashSelfAttention built the key cu_seqlens from the query length at decode, so
each one-token step attended one key row of the flattened cache, not its own prefix). Wrong: the program's own
positions and its own prefill say the query has keys before it.

Quiet where the step has more keys than queries (a cache read, evicted or windowed as it may be), where the
positions are not stated (placing.py then places the queries at the keys' end), where the first pass lets no query
see an earlier key (each token alone), where the step has as many keys as that pass or more (chunks of a stream
encoded apart, each its own sequence), where the first pass showed the step's positions no key outside their own
span (a packed document run again alone at its positions, as a reference does), and where the model call states it
keeps no cache (use_cache=False, none handed: transformers then builds its mask over the call's own tokens alone, a
suffix run at its true position_ids, as a receptive-field reference does).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _first_pass(call, own: np.ndarray) -> bool:
    """The call is a first pass (queries at 0 .. L - 1 over L keys) in which some query sees an earlier key."""
    q_len, k_len = call.shape[2:]
    if q_len < 2 or q_len != k_len or own[0] != 0 or not (np.diff(own) == 1).all():
        return False
    cells = keep(call)
    return cells is not None and bool(np.tril(cells.any(axis=tuple(range(cells.ndim - 2))), -1).any())


def _cached_step(call, own: np.ndarray) -> bool:
    """The call is a step behind a cache (fewer queries than keys, placed from position 1 on) that sees some key before
    its own: the layer attends back, as a first pass shows (a prompt fed token by token has no first pass of several)."""
    q_len, k_len = call.shape[2:]
    if not 1 <= q_len < k_len or own[0] < 1 or not (np.diff(own) == 1).all() or int(own[-1]) != k_len - 1:
        return False  # (its positions count its keys from 0, as a first pass's do: fairseq's, from pad + 1, are not read)
    cells = keep(call)
    return cells is not None and bool(cells[..., :k_len - q_len].any())


def _numbering(call) -> dict | None:
    """The positions a program frame numbers the call's queries by, one row for the batch (the `position` a decoder hands
    its RoPE: trace/positionsat.py's query_positions), else None."""
    held = call.details.get("query_positions")
    return held if held is not None and held["rows"].shape == (1, call.shape[2]) else None


def _alone_then(before, own: np.ndarray) -> bool:
    """The first pass held the step's positions as queries, and in some batch row (head) they saw keys of the step's
    own span and none outside it (a packed document, or a left-padded row's real tokens, run again alone at their
    positions: their keys then were their own)."""
    lo, hi = int(own.min()), int(own.max())
    if hi >= before.shape[2]:
        return False
    cells = keep(before)
    if cells is None:
        return False
    rows = cells.reshape(-1, *cells.shape[-2:])[:, lo:hi + 1]  # (batch rows x heads, the step's positions, keys)
    inside = rows[:, :, lo:hi + 1].any(axis=(1, 2))
    outside = rows[:, :, :lo].any(axis=(1, 2)) | rows[:, :, hi + 1:].any(axis=(1, 2))
    return bool((inside & ~outside).any())  # (in some batch row: a left-padded row's real tokens, run again alone)


def uncached(run: Run) -> list:
    """(call, Finding) for the first step of each site handed only its own keys while placed past them all."""
    found = []
    for where, calls in run.sites().items():
        before = None
        for call in sorted(calls, key=lambda c: c.index):
            top, own, _ = run.placed(call)
            held = _numbering(call)
            own = own if held is None else held["rows"][0]
            q_len, k_len = call.shape[2:]
            if _first_pass(call, own) or held is not None and _cached_step(call, own):  # (a step's numbering read,
                # not placed at its keys' end: its own stated positions say it attends back)
                before = call
                continue
            if before is None or not q_len or q_len != k_len or own[0] < k_len or k_len >= before.shape[3] \
                    or _alone_then(before, own) or top is not None and top.arguments.get("no_cache"):
                continue  # (no_cache: use_cache=False and none handed, trace/tops.py: no cache to continue)
            said = f"`{held['name']}` in {held['function']}()" if held is not None else "the model call's positions" \
                if top is None else f"the positions {top.where} states"
            first = "the first pass" if before.shape[2] == before.shape[3] else f"step {before.step}"
            found.append((call, Finding("decode-keys-missing", (
                f"query 0 sits at position {int(own[0])} ({said}) but is handed only {k_len} key(s), as many as its "
                f"queries, "
                f"though {first} at this site ({before.shape[3]} keys) let its queries see the keys before them: "
                f"the keys before the step (its cache) never reached the kernel"),
                expected=f"the keys 0..{int(own[0])} of the sequence", source=said, cell=(0, 0, 0))))
            break
    return found


RULES = (
    Rule("decode-keys-missing", "wrong", "steps", "a step placed by its positions past every key it is handed, fewer "
         "than its site's first pass attended: the cache never reached the kernel", uncached),
)
