"""A recurrent-memory model that states its memory length, whose queries see keys older than that memory.

Transformer-XL and its kin (the Feedback Transformer) attend over a memory of past positions followed by the segment's
own tokens, and keep the last `mem_len` positions of that memory (the model's own `self.mem_len`, read by
trace/stated.py). Where a call's queries are its last keys (each sees its own key and none after it: the segment at
the end of memory + segment) and a query sees a key more than `mem_len` positions before the segment, the memory was
never cut to its length (feedback-transformer-pytorch 683bba1: `memory_keys[-mem_len:]` slices the batch axis). A
longer buffer whose older keys the mask hides is quiet: only what a query sees counts. Quiet where the model holds
another memory count beside it (a compressed memory's `cmem_len`: trace/stated.py states none then), on
cross-attention, and where the queries are not the last keys (XLNet's two streams: not causal at the bottom right).

The other way round (memory_not_kept): a step whose memory holds fewer keys than min(mem_len, the site's last memory
+ its segment), none of them a reset's empty memory, dropped keys the model states it keeps (Transformers-RL#7).
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
        length, source, scope = _length(top, said[0])
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


def _length(top, said) -> tuple:
    """(mem_len, its source, the scope it speaks for) of a model call: the outermost module's own as the call ran
    (trace/memslots.memory_length), where the config read after the run is that module's and says otherwise (a model
    re-lengthed for evaluation); else the config's."""
    length, source, scope = said.fields[FIELD], said.source, said.fields.get("mem_scope") or ""
    then = top.arguments.get(FIELD)
    if isinstance(then, int) and then != length and not scope:
        return then, f"self.{FIELD}={then} of {top.where} as this call ran", scope
    return length, source, scope


def memory_not_kept(run: Run) -> list:
    """Calls under a module stating `mem_len` whose memory (the keys before the segment, the queries the last keys)
    holds fewer keys than the model keeps: after a call of M memory keys and a segment of L at the same site, the
    next call's memory is min(mem_len, M + L) (Transformer-XL's `cat([mem, h])[max(0, end - mem_len):end]`). A call
    with no memory starts the site again (a new rollout, a reset); a memory that shrinks, or stops growing short of
    mem_len, dropped keys the model states it keeps (Transformers-RL#7: `beg_idx = end_idx - mem_len` with mem_len the
    memory's current length, so the memory stayed at its first 20 slots while the model said 100)."""
    found, kept, done = [], {}, set()  # (site -> (memory keys, segment) of its last step; the sites said)
    for top in run.tops:
        said = [one for one in top.stated if FIELD in one.fields]
        if not said:
            continue
        length, source, scope = _length(top, said[0])
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            continue
        sites: dict = {}
        for call in run.made_by(top):
            if not cross(call) and not (scope and not (call.where or "").startswith(scope)):
                sites.setdefault(call.where, []).append(call)
        for where, calls in sites.items():
            before = kept.get(where)
            for call in calls:
                if where in done:
                    break
                q_len, k_len = call.shape[2], call.shape[3]
                held = k_len - q_len
                cells = keep(call)
                if held < 0 or cells is None or not _last_keys(cells.any(axis=1)).all():
                    before = None  # (not a segment after its memory: nothing to count from)
                    continue
                if before is not None and 0 < held < min(length, before[0] + before[1]):
                    want = min(length, before[0] + before[1])
                    found.append((call, Finding("memory-not-kept", (
                        f"at step {call.step} the segment's queries see {held} memory keys, yet the step before held "
                        f"{before[0]} and added a segment of {before[1]}, and {source} keeps a memory of {length}: "
                        f"{want - held} keys the model states it keeps were dropped (the memory cut to its own current "
                        f"length, not to mem_len?)"), expected=f"{want} memory keys", source=source,
                        cell=None)))
                    done.add(where)  # (once a site: every later step repeats it)
                before = (held, q_len)
            kept[where] = before
    return found


RULES = (
    Rule("memory-over-length", "wrong", "steps", "a recurrent-memory model's queries (its segment, the last keys) see "
         "a key older than the `mem_len` positions of memory the model itself states", over_memory),
    Rule("memory-not-kept", "wrong", "steps", "a recurrent-memory model whose memory at a step holds fewer keys than "
         "min(mem_len, the last step's memory + segment), mem_len the model's own: the memory cut to its current "
         "length, not to mem_len", memory_not_kept),
)
