"""A cross-attention handed no mask for its context, whose keys are hidden exactly where its queries are padding.

A layer handed the other sequence (`context`, `encoder_hidden_states`, `memory`: checks/context.crossing's "memory") and
None for that sequence's mask (`context_mask=None`, `encoder_attention_mask=None`) states that the context has no
padding: every query sees every context key. Where the kernel's mask still hides, in some batch row, exactly the key
columns that the program's own padding mask of the *queries* (a held `mask` / `attention_mask` as long as the queries,
checks/held.py's readings) marks as padding, the queries' mask was applied to the context's keys (x-transformers
b0715f2: `input_mask = default(context_mask, mask)`). Quiet where the hidden columns differ from the queries' padding
in any row (another reason to hide them), where no row hides any, or where a context mask was handed at all.

The same slip where a mask is handed: a seq2seq model that states each side's padding (its source and target ids at
each side's pad id, checks/sides.py's side_tokens) whose cross-attention hides, from every query of each row, exactly
the key columns the *target* pads, among them keys its source calls real, built the memory's mask from the wrong
sequence (pengshuang/Transformer#7: `padding_mask(tgt_seq, src_seq)`; nn.Transformer handed
`memory_key_padding_mask=tgt_key_padding_mask`). Read per batch row, a batch folded with its heads either way round;
quiet where the queries of a row see different keys (a causal self-attention read as a cross one), where the hidden
columns are the source's own padding, or where either side's padding is unstated.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, crossing, keep
from maskcli.checks.held import readings
from maskcli.checks.memturned import by_row
from maskcli.checks.sides import side_tokens
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


def target_padding_on_memory(run: Run) -> list:
    """Cross-attention calls of a seq2seq model that states both sides' padding whose every query of a row hides exactly
    the target's padded columns, some of them real source keys."""
    found, done = [], {}
    for call in run.cross:
        top = run.top(call)
        rows, _, q_len, k_len = call.shape
        if top is None or call.stored is None or not top.arguments or q_len != k_len or q_len < 2:
            continue  # (the target's padding fits the memory's keys only where they are as many)
        source, target = side_tokens(top, "src"), side_tokens(top, "trg")
        if source is None or target is None or source[0].shape != target[0].shape or source[0].shape[1] != k_len \
                or rows % source[0].shape[0]:
            continue
        key = (call.mask, call.shape, source[0].tobytes(), target[0].tobytes())
        if key not in done:
            done[key] = _target_on_memory(call, rows, source, target)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _target_on_memory(call, rows: int, source, target) -> Finding | None:
    cells = by_row(call, rows)
    if cells is None:
        return None
    hidden = ~cells.any(axis=1)  # (rows, Lk): the key columns no query of the row sees
    asking = cells.any(axis=-1)  # (rows, Lq): the queries that see some key
    if not hidden.any() or not ((cells == ~hidden[:, None, :]) | ~asking[:, :, None]).all():
        return None  # (a row whose queries see different keys: not a key padding)
    size, at = source[0].shape[0], np.arange(rows)
    for order in (at % size, at // (rows // size)):  # (a batch folded with its heads: head-major or batch-major)
        src_real, trg_real = source[0][order], target[0][order]
        wrong = hidden & src_real
        if np.array_equal(hidden, ~trg_real) and wrong.any():
            b = int(np.flatnonzero(wrong.any(axis=1))[0])
            k = int(np.flatnonzero(wrong[b])[0])
            q = int(np.flatnonzero(asking[b])[0]) if asking[b].any() else 0
            reading = crossing(call)
            folded = f" (of {size} samples folded with {rows // size} rows each)" if rows != size else ""
            return Finding("context-masked-by-queries", (
                f"batch row {b}{folded}: the cross-attention ({reading.source or 'its keys another sequence'}) hides "
                f"memory keys {np.flatnonzero(hidden[b]).tolist()} from every query, exactly the target's padding "
                f"({target[1]}), though {source[1]} calls key {k} real ({int(wrong.sum())} such keys): the target's "
                f"padding mask applied to the memory's keys"),
                expected="the memory's keys hidden where the source is padded", source=source[1], cell=(b, q, k))
    return None


RULES = (
    Rule("context-masked-by-queries", "wrong", "call", "a cross-attention that hides the context keys at exactly the "
         "queries' padding (handed no context mask, or the target's padding where the source's was meant): the "
         "decoder's mask applied to the context", lambda run: queries_padding_on_context(run) + target_padding_on_memory(run)),
)
