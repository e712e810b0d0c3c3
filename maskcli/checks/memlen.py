"""A recurrent-memory model that states its memory length, whose queries see keys older than that memory.

Transformer-XL and its kin (the Feedback Transformer) attend over a memory of past positions followed by the segment's
own tokens, and keep the last `mem_len` positions of that memory (the model's own `self.mem_len`, read by
trace/stated.py). Where a call's queries are its last keys (each sees its own key and none after it: the segment at
the end of memory + segment) and a query sees a key more than `mem_len` positions before the segment, the memory was
never cut to its length (feedback-transformer-pytorch 683bba1: `memory_keys[-mem_len:]` slices the batch axis). A
longer buffer whose older keys the mask hides is quiet: only what a query sees counts. Quiet where the model holds
another memory count beside it (a compressed memory's `cmem_len`: trace/stated.py states none then), on
cross-attention, and where the queries are not the last keys (XLNet's two streams: not causal at the bottom right).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

FIELD = "mem_len"


def _last_keys(cells: np.ndarray) -> np.ndarray:
    """Bool (rows,): batch rows whose every query i sees key Lk - Lq + i and no key after it."""
    rows, q_len, k_len = cells.shape
    own = k_len - q_len + np.arange(q_len)
    sees_own = cells[:, np.arange(q_len), own].all(axis=1)
    later = np.arange(k_len)[None, :] > own[:, None]
    return sees_own & ~(cells & later[None]).any(axis=(1, 2))


def over_memory(run: Run) -> list:
    """Calls under a module stating `mem_len` whose queries, the last keys, see a key before the last mem_len memory
    positions."""
    found = []
    for top in run.tops:
        said = [one for one in top.stated if FIELD in one.fields]
        if not said:
            continue
        length, source, scope = said[0].fields[FIELD], said[0].source, said[0].fields.get("mem_scope") or ""
        done = set()
        for call in run.made_by(top):
            q_len, k_len = call.shape[2], call.shape[3]
            if k_len - q_len <= length or cross(call) or scope and not (call.where or "").startswith(scope):
                continue
            if (call.mask, call.shape) in done:
                continue
            done.add((call.mask, call.shape))
            cells = keep(call)
            if cells is None:
                continue
            cells = cells.any(axis=1)
            placed = _last_keys(cells)
            oldest = k_len - q_len - length  # keys before this one are older than the memory holds
            bad = cells[:, :, :oldest] & placed[:, None, None]
            if not bad.any():
                continue
            b, q, k = (int(x[0]) for x in np.nonzero(bad))
            found.append((call, Finding("memory-over-length", (
                f"batch row {b}: query {q} sees key {k}, {k_len - q_len - k} positions before its segment, while "
                f"{source} keeps a memory of {length} ({k_len - q_len} memory keys at this call): the memory was never "
                f"cut to its length (sliced on another axis?)"),
                expected=f"at most {length} memory keys seen before the segment", source=source, cell=(b, q, k))))
    return found


RULES = (
    Rule("memory-over-length", "wrong", "steps", "a recurrent-memory model's queries (its segment, the last keys) see "
         "a key older than the `mem_len` positions of memory the model itself states", over_memory),
)
