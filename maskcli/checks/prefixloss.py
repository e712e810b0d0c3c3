"""A prefix LM's loss against its attention: the token just after the bidirectional prefix is neither read nor learnt.

- prefix-target-skipped: a batch row's attention is a prefix LM (its first real query sees exactly the real keys
  [s, P), P - s >= 2, as does every query of that prefix; each later query sees no key after itself), and the program's
  loss (trace/losses.py: targets that are the model call's ids shifted by one, less those ignored or weighed 0 by the
  loss mask the program holds) counts its first query at P: the last prefix query P - 1, which does not see token P,
  is not asked to predict it, so token P is neither inside the prefix nor any query's target
  (bigscience-workshop/Megatron-DeepSpeed#167: `loss_mask[b, :prefix_index] = 0` beside a prefix of prefix_index
  tokens; the fix masks `[:prefix_index - 1]`). Left alone: a row whose first query sees only itself (no prefix to
  speak of), and a loss that starts two or more tokens after the prefix (a causal prompt left untrained, as SFT does).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.checks.tokens import _calls, predicting
from maskcli.text import Finding


def _prefix(seen: np.ndarray, real: np.ndarray) -> int | None:
    """P where the row's cells (Lq, Lk) are a prefix LM over its real tokens [s, e) (one run): queries in [s, P) see
    exactly [s, P), later ones nothing after themselves; None otherwise or where P - s < 2."""
    where = np.flatnonzero(real)
    if where.size < 3 or where[-1] - where[0] + 1 != where.size:
        return None
    s, e = int(where[0]), int(where[-1]) + 1
    first = np.flatnonzero(seen[s] & real)
    if first.size < 2 or first[0] != s or first[-1] - s + 1 != first.size:
        return None
    p = int(first[-1]) + 1
    inside = seen[s:p][:, real]
    if not (inside == (np.arange(seen.shape[1])[real] < p)[None]).all():
        return None
    later = np.triu(seen[p:e][:, s:e], k=p - s + 1)  # (query q, key k > q)
    return None if later.any() else p


def skipped(run: Run) -> list:
    """Rows whose loss starts one query after the last prefix query: the token after the prefix is never a target."""
    found = []
    for top, predicts in predicting(run):
        rows, length = predicts.shape
        given = stated(top, rows, length)
        real = np.ones((rows, length), bool) if given is None else np.broadcast_to(given[0], (rows, length))
        for call, cells, own in _calls(run, top, rows, length):
            if call.shape[2] != length or not (own == np.arange(length)).all():
                continue
            bad = []
            for b in range(rows):
                p = _prefix(cells[b], real[b])
                counted = np.flatnonzero(predicts[b] & real[b]) if p is not None else ()
                if p is not None and len(counted) and counted[0] == p:
                    bad.append((b, p))
            if bad:
                b, p = bad[0]
                found.append((call, Finding("prefix-target-skipped", (
                    f"batch row {b}: its bidirectional prefix ends before token {p}, and the program's loss starts "
                    f"at query {p}: query {p - 1}, the last of the "
                    f"prefix, does not see token {p} yet is not asked to predict it, so token {p} is neither read "
                    f"both ways nor learnt ({len(bad)} such rows): the loss mask is one token off the prefix"),
                    expected=f"the loss from query {p - 1}", source="the loss's targets and the loss mask",
                    cell=(b, p - 1, p))))
                break
    return found


RULES = (
    Rule("prefix-target-skipped", "wrong", "steps", "a prefix LM whose loss starts one query after the last prefix "
         "query: the token after the prefix is neither read both ways nor a target", skipped),
)
