"""A mask the program names causal that is not: the model call is handed `decoder_causal_mask` / `causal_mask` (its
name the program's word, trace/causalarg.py) whose cells let a query see a later key, and a self-attention of that call
over its L tokens sees that later key (the mask reached the kernel as it is).

JohnSnowLabs/spark-nlp#2149: MarianTransformer built the decoder's "causal mask" with `Float(0)` in every cell and fed
it to the exported decoder as an additive bias, so each greedy step's decoder self-attention saw the later tokens of
the prefix. Read only on a square self-attention call of that model call (Lq = Lk = L, queries from position 0),
batch rows matched or broadcast; a mask named causal that hides every later key is quiet, whatever the rest of it
(padding) does; so is a name that says otherwise (`non_causal_mask`, causalname.py).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.arguments import _cells_by_row
from maskcli.checks.context import Run, columns_are_positions, cross, first_cell, queries, triu
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def named_causal(run: Run) -> list:
    """Self-attention calls that see a later key the mask the model call was handed under a causal name keeps."""
    found, done = [], set()
    for call in [*run.calls, *[c for c in run.unmasked if not cross(c)]]:
        top = None if call.stored is None else run.top(call)
        said = None if top is None else top.arguments.get("causal_named")
        if said is None or cross(call) or id(top) in done:
            continue
        name, kept = said
        rows, length = kept.shape[0], kept.shape[-1]
        later = triu(kept, k=1)
        if not later.any() or call.shape[2] != length or call.shape[3] != length \
                or not columns_are_positions(call, top) or int(queries(call, top)[0]) != 0:
            continue
        batch = max(rows, call.shape[0])
        if call.shape[0] not in (1, batch) or rows not in (1, batch):
            continue
        cells = _cells_by_row(call, call.shape[0])
        if cells is None:
            continue
        bad = np.broadcast_to(cells, (batch, length, length)) & np.broadcast_to(later, (batch, length, length))
        if not bad.any():
            continue
        done.add(id(top))
        b, q, k = first_cell(bad)
        whole = " (every cell of it 0: no cell masked)" if kept.all() else ""
        found.append((call, Finding("named-causal-sees-later", (
            f"{top.where} is handed `{name}`, a mask its name says is causal, yet it keeps {int(later.sum())} "
            f"cell{'' if later.sum() == 1 else 's'} above the diagonal{whole}, and this self-attention over the {length} tokens sees them: batch row {b}'s "
            f"query {q} sees later key {k} ({int(bad.sum())} such cells)"),
            expected=f"causal, as `{name}` says", source=f"`{name}` handed to {top.where}", cell=(b, q, k))))
    return found


RULES = (
    Rule("named-causal-sees-later", "wrong", "steps", "a self-attention that sees a later key which the mask its model "
         "call was handed under a causal name keeps (spark-nlp#2149: the decoder's `causal mask` filled with 0)",
         named_causal),
)
