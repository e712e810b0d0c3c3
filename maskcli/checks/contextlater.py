"""A query that sees a context key at a later position than its own, the positions the program's frames hold.

A drafter trained on tokens gathered out of order (DFlash's sampled anchor blocks: each block of q noise tokens
attends the target's hidden states of the tokens before its anchor, laid [context | blocks]) rotates its keys by
position ids that cover every key, the queries' own at the end, held under `position_ids` / `positions` by the function
that runs it (trace/held.py: ids that go down without restarting at 0, details["held_positions"]). The keys before the
queries' own (the context) are the tokens the drafter reads; a query that sees one whose position is later than its
own reads the future it is trained to predict (SpecForge 41e252e: the context visible by block id, `k_ids < q_ids`,
while sampled blocks overlap, so a block saw the target's hidden states at positions past its own anchor). Read per
batch row over the heads, where the held ids are as many as the call's keys and the call has fewer queries than keys;
the queries' own keys (the last Q) may be seen both ways (a block drafted bidirectionally); cross-attention is left
alone.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.eachheld import first_findings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def context_later(run: Run) -> list:
    """Calls whose query sees a context key whose held position is later than the query's."""
    return first_findings(run, "held_positions", lambda call: call.shape[2] < call.shape[3], _judged)


def _judged(call, held: dict) -> Finding | None:
    """The finding for `call` against the held (B or 1, Lk) positions, None where they are not its keys' or no query
    sees a later context key."""
    rows, _, q_len, k_len = call.shape
    positions = held["rows"]
    cells = None if positions.shape[1] != k_len or positions.shape[0] not in (1, rows) else keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    positions = np.broadcast_to(positions, (rows, k_len))
    context = k_len - q_len
    seen = cells.any(axis=1)[..., :context]  # (B, Q, context): over the heads
    own = positions[:, context:]  # (B, Q): the queries' positions
    later = seen & (positions[:, None, :context] > own[:, :, None])
    if not later.any():
        return None
    b, i, j = first_cell(later)
    said = f"{held['name']} in {held['where']}"
    return Finding("context-seen-later", (
        f"query {i} of batch row {b}, at position {int(own[b, i])} by {said}, sees context key {j} at position "
        f"{int(positions[b, j])} ({int(later.sum())} such cells): a query reads no context past its own position"),
        expected="context keys at positions before each query's", source=said, cell=(b, i, j))


RULES = (
    Rule("context-seen-later", "wrong", "call", "a query that sees a context key (one before the queries' own keys) "
         "whose position, by the position ids the program's frames hold over every key, is later than its own",
         context_later),
)
