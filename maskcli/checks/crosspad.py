"""A cross-attention handed no mask for its context, whose keys are hidden exactly where its queries are padding.

A layer handed the other sequence (`context`, `encoder_hidden_states`, `memory`: checks/context.crossing's "memory") and
None for that sequence's mask (`context_mask=None`, `encoder_attention_mask=None`) states that the context has no
padding: every query sees every context key. Where the kernel's mask still hides, in some batch row, exactly the key
columns that the program's own padding mask of the *queries* (a held `mask` / `attention_mask` as long as the queries,
checks/held.py's readings) marks as padding, the queries' mask was applied to the context's keys (x-transformers
b0715f2: `input_mask = default(context_mask, mask)`). Quiet where the hidden columns differ from the queries' padding
in any row (another reason to hide them), where no row hides any, or where a context mask was handed at all.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.held import readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def queries_padding_on_context(run: Run) -> list:
    """Cross-attention calls handed no context mask whose hidden key columns are the queries' own padding."""
    found, done = [], {}
    for call in run.cross:
        details, reading = call.details, crossing(call)
        unmasked = (details.get("cross") or {}).get("unmasked") if reading.by == "memory" else None
        held = details.get("held_padding")
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if not unmasked or not held or q_len != k_len or q_len < 2:
            continue  # (a queries' mask fits the keys only where they are as many)
        key = (call.mask, call.shape, unmasked)
        if key not in done:
            done[key] = None
            cells = keep(call)
            if cells is None or cells.shape[0] not in (1, rows):
                continue
            seen = np.broadcast_to(cells.any(axis=(1, 2)), (rows, k_len))  # a key column any query of the row sees
            if seen.all():
                continue
            for padding in held:
                for real in readings(padding, rows, q_len):
                    if not real.all() and np.array_equal(seen, real):
                        b = int(np.flatnonzero(~real.all(axis=1))[0])
                        k = int(np.flatnonzero(~real[b])[0])
                        done[key] = Finding("context-masked-by-queries", (
                            f"the cross-attention ({reading.source}) was handed {unmasked}=None, an "
                            f"unpadded context, yet batch row {b} hides context keys {np.flatnonzero(~real[b]).tolist()}: "
                            f"exactly the queries' padding in `{padding['name']}` ({padding['where']}): the queries' "
                            f"mask applied to the context's keys"),
                            expected="every query sees every context key", source=f"{unmasked}=None", cell=(b, 0, k))
                        break
                if done[key] is not None:
                    break
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("context-masked-by-queries", "wrong", "call", "a cross-attention handed no context mask that hides the context "
         "keys at exactly the queries' padding: the decoder's mask applied to the context", queries_padding_on_context),
)
