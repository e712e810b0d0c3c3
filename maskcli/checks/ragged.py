"""Lengths a call site runs over one sequence at a time: a ragged batch packed with no padding, not a padded one.

An engine that packs requests into one token stream (SGLang's extend kernels, a packed encoder) may attend each
request on its own, in a loop: one call per request, each over exactly its own tokens. The batch's lengths are then
held (or handed to the model call) at every such call, and the call whose keys are the longest request's looks like
a padded batch's row whose shorter rows see their padding; its batch axis may even be as long as the lengths (the
heads of one request). A padded batch's calls have at least the longest row's keys; a loop over requests has, at
one site, as many calls of each length as the lengths hold (once per forward). Read once per run.
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def one_at_a_time(run, call, lengths, holds=None, key=None) -> bool:
    """Whether `call`'s site (masked calls and unmasked softmaxes alike) has, among its calls for which `holds(other)`
    is true, as many keys as each of `lengths` (at least two values), each as often as the lengths hold it (or the
    same multiple of that: a batch folded with its heads, several forwards): one call per sequence. `holds` None:
    every call of the site; `key` names `holds` for the run's memo (a site's counts are read once per key)."""
    wanted = Counter(int(n) for n in np.asarray(lengths).ravel())
    if len(wanted) < 2:
        return False
    memo = run.__dict__.setdefault("_ragged", {})
    size = (len(run.calls), len(run.unmasked))
    if memo.get("size") != size:
        memo.clear()
        memo["size"] = size
        by: dict = {}
        for one in [*run.calls, *run.unmasked]:
            by.setdefault(one.where, []).append(one)
        memo["sites"] = by
    name = (call.where, key)
    keys = memo.get(name) if key is not None else None
    if keys is None:
        keys = Counter(int(one.shape[3]) for one in memo["sites"].get(call.where, ()) if holds is None or holds(one))
        if key is not None:
            memo[name] = keys
    if set(keys) != set(wanted):
        return False
    return len({keys[n] / wanted[n] for n in wanted}) == 1
