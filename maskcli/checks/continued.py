"""Rows run after the rows before them, each seeing fewer keys than the same rows in one pass over them all.

A program that runs its model on a stretch of rows in one pass (a table's train and test items, a time-major
sequence) and again on the same rows in two calls, the first rows then the rest, states that the second call
continues the first: a model that caches what its first call wrote (TabPFN's fit_with_cache, a decoder's K/V) shows
each row of the second what the one pass shows it. Told by the rows themselves: every tensor argument the one pass
and the second call share, row for row along their first axis (trace/samplerows.py), is the first call's rows then
the second's. A query of the second call (its last rows, aligned with the one pass's last) that sees fewer keys than
the one pass shows the same row, at a site of the same batch rows that the one pass calls once, is wrong (PriorLabs/TabPFN#852: the thinking tokens
prepended again at prediction moved single_eval_pos, so the test rows saw the 4 fresh thinking rows and overwrote the
cached 14). Quiet where the second call sees as many keys (the cache read), where the rows are not the one pass's
split in two in order, where no module state (a tensor assigned to a module's attribute, trace/assigned.py) was
written between the two calls' starts (two halves run apart on purpose), on batch-major ids (their first axis is
the batch: rows are whole sequences), and at a site the one pass calls in pieces (a vision encoder's softmax per
image, GLM-4V's eager attention over cu_seqlens: no one call holds the rows, so none is aligned with the second's).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _split(run: Run) -> list:
    """(one pass, first call, second call, the rows the second runs) of one module, the second after the first.
    Found through an index of each call's row hashes per argument (a pass over every triple of calls would be
    cubic in a run's model calls: a decode loop of thousands)."""
    held = [(at, top, dict(top.rows)) for at, top in enumerate(run.tops) if top.rows]
    index, lengths = {}, {}
    for at, top, rows in held:
        for name, hashes in rows.items():
            index.setdefault((top.where, name, hashes), []).append((at, top, rows))
            lengths.setdefault((top.where, name), set()).add(len(hashes))
    found = set()
    for w, whole, rows in held:
        for name, hashes in rows.items():
            for m in lengths[(whole.where, name)]:
                if not 0 < m < len(hashes):
                    continue
                firsts, seconds = index.get((whole.where, name, hashes[:m])), index.get((whole.where, name, hashes[m:]))
                for f, first, head in firsts or ():
                    for s, second, tail in seconds or ():
                        if s > f and first is not whole and second is not whole and tail.keys() <= rows.keys() \
                                and tail.keys() <= head.keys() \
                                and all(len(tail[n]) and head[n] + tail[n] == rows[n] for n in tail) \
                                and _kept_state(first, second):
                            found.add((w, f, s, len(next(iter(tail.values())))))
    tops = run.tops
    return [(tops[w], tops[f], tops[s], n) for w, f, s, n in sorted(found)]


def _kept_state(first, second) -> bool:
    """The first call (or what ran after it, before the second) assigned tensors to a module's attributes: state kept
    for the next call (a K/V cache), the program's statement that the second continues the first. Without it, two
    calls over halves of a sequence are two sequences (a context-free evaluation of each half), not a continuation."""
    before, after = first.state_writes, second.state_writes
    return type(before) is int and type(after) is int and after > before


def _seen(call):
    """Keys each query sees, (b, Lq), any head; None where the mask is not kept."""
    cells = keep(call)
    return None if cells is None else cells.any(axis=1).sum(axis=-1)


def _made_by(run: Run, top) -> list:
    """The calls of `top`, in order: cross ones (queries apart from keys) and those of sites that mask nowhere too."""
    return sorted((call for call in (*run.calls, *run.cross, *run.unmasked) if top.first <= call.index < top.end),
                  key=lambda call: call.index)


def continued(run: Run) -> list:
    """The queries of a continuing call that see fewer keys than the one pass shows their rows (_split)."""
    found = []
    for whole, first, second, n in _split(run):
        made = _made_by(run, whole)
        times = Counter(call.where for call in made)  # (a site the one pass calls in pieces, one per image: no call
        ones = {call.where: call for call in made if times[call.where] == 1}  # holds its rows)
        for call in _made_by(run, second):
            one = ones.get(call.where)
            if one is None or one.shape[0] != call.shape[0] or min(one.shape[2], call.shape[2]) < n:
                continue
            mine, theirs = _seen(call), _seen(one)
            if mine is None or theirs is None:
                continue
            short = mine[:, -n:] < theirs[:, -n:]
            if not short.any():
                continue
            b, j = (int(x) for x in np.argwhere(short)[0])
            q = call.shape[2] - n + j
            found.append((call, Finding("continued-keys-dropped", (
                f"batch row {b}: query {q} (row {j} of the {n} rows given to {second.where} after {first.where} was "
                f"given the rows before them) sees {int(mine[b, -n + j])} keys, where the one pass over all of them shows "
                f"the same row {int(theirs[b, -n + j])} at this site: the call that continues the first dropped keys "
                f"the one pass holds (a cache replaced, not read?)"),
                expected=f"{int(theirs[b, -n + j])} keys, as in the one pass", source=f"{whole.where}'s one pass",
                cell=(b, q))))
    return found


RULES = (
    Rule("continued-keys-dropped", "wrong", "steps", "rows run after the rows before them (every shared tensor argument "
         "the one pass's rows split in two, in order) whose queries see fewer keys than the same rows in one pass: a "
         "cache replaced where it should be read", continued),
)
