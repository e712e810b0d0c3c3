"""A batch row whose queries see no key, where the program changes its padding mask in place after the call so that
the row keeps a key: the fix-up for rows with no key ran after the attention instead of before it.

A padding mask that hides every key of a batch row (an empty history, a user with no behaviors) leaves the row's
queries nothing: SDPA and MHA give them 0, a softmax NaN. Programs that meet such rows unmask one key of each of them
(FuxiCTR's `adjust_mask`: `mask[mask.all(dim=-1), -1] = 0`), and that step only helps the attentions after it.
FuxiCTR 3a060ba: TransAct handed the raw key_padding_mask to nn.TransformerEncoder and called adjust_mask, which
writes into the same tensor, only before its max pooling, so the empty user's transformer output was zero.

The program states both masks: the padding mask its frames hold at the call (trace/held.py: read there, as it is
then) and the model call's argument of that name as the call ends (checks/context.py's Top: read when the model call
is finished). Wrong where they differ only by keys unmasked in rows the mask at the call hid whole (whichever way
round the mask is read: the way the call's mask keeps to it), and the call's mask hid every key of those rows from
every query. Quiet where the fix-up runs before the call (both read alike), where the mask changes in other rows too
(a buffer refilled for the next batch), and where the call's mask does not keep to the held one.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _late(call, held: dict, after: np.ndarray) -> Finding | None:
    """The finding for `call` whose held padding mask `held` (at the call) became `after` (bool, as the model call
    ended); None where that is no fix-up of rows the call left with no key."""
    before = held["rows"]
    cells = keep(call)
    if cells is None or cells.shape[3] != before.shape[1] or cells.shape[0] not in (1, before.shape[0]):
        return None
    seen = np.broadcast_to(cells.any(axis=(1, 2)), before.shape)  # (B, Lk): the keys some query of the row sees
    blind = ~np.broadcast_to(cells.any(axis=3).any(axis=1), (before.shape[0], call.shape[2]))  # (B, Lq) no key at all
    for real in (before, ~before):  # (the way round the call's mask keeps to it: True = real, or True = padding)
        if not (seen == real).all():
            continue
        hidden = ~real.any(axis=1)  # (B,): rows the mask at the call hides whole
        now = after if real is before else ~after
        changed = now != real
        if not changed.any() or changed[~hidden].any() or (now & ~real).sum() != changed.sum() \
                or not blind[changed.any(axis=1)].all():
            return None  # (unchanged; changed elsewhere too; keys masked, not unmasked; or rows the call left keys)
        rows = [int(b) for b in np.flatnonzero(changed.any(axis=1))]
        b = rows[0]
        keys = [int(k) for k in np.flatnonzero(changed[b])]
        name, where = held["name"], held["where"]
        return Finding("mask-fixed-after-call", (
            f"batch row{'s' if len(rows) > 1 else ''} {spans(rows)}: every query sees no key, as the padding mask "
            f"`{name}` ({where}) hides every key of the row at the call; after the call the program changed "
            f"`{name}` in place to unmask key{'s' if len(keys) > 1 else ''} {spans(keys)} of row {b} (a fix-up of "
            "rows with no key, as FuxiCTR's adjust_mask), which this attention never saw: apply it before the call"),
            expected=f"key {spans(keys)} of batch row {b} seen, as `{name}` holds it after the call",
            source=f"`{name}` as the model call ended", cell=(b, 0, keys[0]))
    return None


def fixed_after_call(run: Run) -> list:
    """Calls whose rows with no key are the ones the program's padding mask, changed in place after the call,
    gives a key (module docstring)."""
    found, done = [], {}
    for call in (*run.calls, *run.cross):
        top = run.top(call)
        if top is None or not top.arguments:
            continue
        for held in call.details.get("held_padding") or ():
            given = top.arguments.get(held.get("name"))
            rows = held.get("rows")
            if held.get("kind") not in ("keep", "pad") or not isinstance(given, np.ndarray) \
                    or not isinstance(rows, np.ndarray) or given.shape != rows.shape or given.ndim != 2:
                continue
            after = given != 0
            if (after == rows).all():
                continue
            key = (call.mask, call.shape, held["name"], id(top))
            if key not in done:
                done[key] = _late(call, held, after)
            if done[key] is not None:
                found.append((call, done[key]))
                break
    return found


RULES = (
    Rule("mask-fixed-after-call", "wrong", "steps", "a batch row whose queries see no key, whose padding mask the "
         "program changes in place after the call to unmask a key of each such row (FuxiCTR 3a060ba: TransAct's "
         "adjust_mask ran after nn.TransformerEncoder, so an empty history's output was zero)", fixed_after_call),
)
