"""Query rows that see no key, trained on: a loss that counts the predictions of rows whose finite fill gives them
uniform weights over every key, the later ones included, in a self-attention causal everywhere else.

A row whose every key is masked with a finite fill (masked_fill(-max), finfo.min) takes the softmax of equal values:
uniform weights over the whole row, the keys after its query among them. Such rows are routine where their output is
never read (padding queries, their targets ignored). Where the model call's loss counts the target at that row
(trace/losses.py: the targets it was handed, `loss_counted`, not the ignore index and not weighed 0 by a loss mask, as
many as the call's queries: (B, Lq), or its first Lq - 1 positions, shifted), the row's prediction is trained on the
tokens after it, which every other row of the call is masked from: its own target among them where the row predicts
the next one. lucidrains/DALLE-pytorch 9bf1f0f: the caption's padding mask was applied to the queries as well as the
keys (`mask[:, None, :, None] * mask[:, None, None, :]`), so a padded caption position's row was filled whole with the
causal fill's own value and attended every image token; the loss counted those positions (labels `text[:, 1:]`, pad
id 0, no ignore_index). Quiet where the row keeps a key (the fix: the mask on the keys alone), where the loss ignores
those targets, under a kernel or program that gives such rows 0 (SDPA, a fill of -inf then zeroed), and where the call
lets some row that does see keys see a later one (no causal statement to hold the empty rows to).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.kernelrows import what_api_does
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _counted(top, rows: int, q_len: int) -> np.ndarray | None:
    """Bool (B, Lq): the query rows whose target the model call's loss counts, where a loss's targets lie over them."""
    for counted in reversed(top.loss_counted):
        if counted.size == rows * q_len:
            return counted.reshape(rows, q_len)
        if counted.size == rows * (q_len - 1):  # (the logits' last position left out: shifted targets)
            return np.concatenate([counted.reshape(rows, q_len - 1), np.zeros((rows, 1), bool)], axis=1)
    return None


def empty_rows_trained(run: Run) -> list:
    """Self-attention calls whose rows that see no key (a finite fill: uniform over every key) a loss counts."""
    found, done = [], set()
    for call in run.calls:
        rows, _, q_len, k_len = call.shape
        top = run.top(call)
        if top is None or q_len != k_len or q_len < 3 or cross(call) or not top.loss_counted:
            continue
        effect = what_api_does(call)
        if not effect.startswith("uniform weights over every key"):
            continue
        key = (call.mask, call.shape, id(top))
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        counted = _counted(top, rows, q_len)
        if cells is None or counted is None or cells.shape[0] not in (1, rows):
            continue
        cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
        empty = ~cells.any(axis=3).any(axis=1)  # (B, Lq): no key in any head
        later = np.triu(np.ones((q_len, k_len), bool), 1)
        seeing = cells.any(axis=1)  # (B, Lq, Lk)
        if (seeing & later).any() or not seeing.sum(axis=2).max() > 1:
            continue  # (a row that sees keys sees a later one: no causal mask to hold the rest to; or none sees two)
        hit = empty & counted & (np.arange(q_len) < k_len - 1)[None, :]
        if not hit.any():
            continue
        b = int(np.flatnonzero(hit.any(axis=1))[0])
        queries = np.flatnonzero(hit[b])
        found.append((call, Finding("empty-rows-trained", (
            f"query row{'s' if len(queries) > 1 else ''} {spans(queries.tolist())} of batch row {b} "
            f"see{'s' if len(queries) == 1 else ''} no key ({effect}), in a self-attention whose every "
            f"other row sees no later key; the loss of {top.where} counts the targets there ({int(hit.sum())} such rows "
            f"in all), so those predictions are trained on the tokens after them (mask the keys alone, or ignore those "
            "targets)"), "wrong", expected="no trained prediction sees a later token",
            source=f"the loss of {top.where}", cell=(b, int(queries[0]), k_len - 1))))
    return found


RULES = (
    Rule("empty-rows-trained", "wrong", "steps", "query rows that see no key under a finite fill (uniform weights over "
         "every key, later ones included) in an otherwise causal self-attention, whose targets the model call's loss "
         "counts", empty_rows_trained),
)
