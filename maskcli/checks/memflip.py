"""An attention over a recurrent memory that sees only the slots the program marks invalid: the memory mask turned round.

The model call states which of its memory's S slots hold a step (trace/memslots.py): a 0/1 (B, S) mask (1 = valid,
`mask`, `memory_mask`) beside the memory itself, a float (B, S, ...) argument whose invalid slots are exactly the
zeros of a buffer nobody wrote yet. An attention of that call over those slots (S keys, or S and up to 4 more: a
TrXL layer appends the query's own token after the memory window, as Transformer-XL lays `cat([mems, h])`)
in which, in every batch row holding both kinds of slot, every query that attends sees some invalid slot and no valid
one, reads the mask the other way round: a keep mask used as a block mask (neroRL 65333f0:
`masked_fill(attn_mask.T.bool(), -inf)` hid the valid memory and the query itself, so the policy attended only the
empty slots; the fix fills where `attn_mask.T == 0`).

Quiet where any such query sees a valid slot (a mask that keeps some of the memory is another rule's business), where
the invalid slots are not the memory's zeros (the program's two statements disagree: nothing to tell the polarity by),
on rows whose slots are all valid or all invalid, and on calls of another batch or key count.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

EXTRA = 4  # keys beside the memory's slots at most (the query's own token, a few registers)


def memory_slots_inverted(run: Run) -> list:
    """Calls whose every attending query of each mixed row sees only memory slots the model call calls invalid."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:
        top = run.top(call)
        if top is None or "memory_slots" not in top.arguments or call.stored is None:
            continue
        key = (call.mask, call.shape, id(top))
        if key not in done:
            done[key] = _finding(call, top)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _turned(seen: np.ndarray, valid: np.ndarray, at: int) -> tuple[int, int, int] | None:
    """(row, query, key) of the first invalid slot seen, where in every mixed row every attending query sees an
    invalid slot and no valid one with the slots at keys at .. at + S - 1; None where some query sees a valid one."""
    slots = valid.shape[1]
    first = None
    for b in np.flatnonzero(valid.any(axis=1) & ~valid.all(axis=1)):
        rows = seen[b][seen[b].any(axis=1)]
        memory = rows[:, at:at + slots]
        if not len(rows) or (memory & valid[b]).any() or not (memory & ~valid[b]).any(axis=1).all():
            return None
        if first is None:
            q = int(np.flatnonzero(seen[b].any(axis=1))[0])
            first = (int(b), q, at + int(np.flatnonzero(seen[b][q, at:at + slots] & ~valid[b])[0]))
    return first


def _finding(call, top) -> Finding | None:
    name, valid, source = top.arguments["memory_slots"]
    rows, length = call.shape[0], call.shape[3]
    slots = valid.shape[1]
    cells = keep(call)
    if cells is None or rows != valid.shape[0] or cells.shape[0] not in (1, rows) or not slots <= length <= slots + EXTRA:
        return None
    seen = np.broadcast_to(cells.any(axis=1), (rows, call.shape[2], length))
    at = 0  # (the memory before the current tokens, as Transformer-XL lays `cat([mems, h])` and its ports after it)
    found = _turned(seen, valid, at)
    if found is None:
        return None
    b, q, k = found
    others = [key for key in range(length) if not at <= key < at + slots]
    own = f"; nor key {spans(others)} past the slots (the query's own token, where a layer appends it)" if others \
        and not seen[b, q, others].any() else ""
    return Finding("memory-slots-inverted", (
        f"batch row {b}: query {q} sees key {k}, memory slot {k - at}, which `{name}` of the model call calls invalid "
        f"and `{source}` holds as exact zeros (never written), and none of slots {spans(np.flatnonzero(valid[b]).tolist())} "
        f"it calls valid{own} — the memory mask read the other way round (a keep mask filled as a block mask?)"),
        expected="the queries see the memory slots the mask calls valid", source=f"{name} of {top.where}",
        cell=(b, q, k))


RULES = (
    Rule("memory-slots-inverted", "wrong", "call", "an attention over a recurrent memory whose queries see only the "
         "slots the model call's memory mask calls invalid, which the memory holds as zeros (a keep mask used as a "
         "block mask: neroRL 65333f0)", memory_slots_inverted),
)
