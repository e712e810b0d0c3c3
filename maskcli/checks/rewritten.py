"""A model call that attends with a batch mask an earlier call's own forward rewrote, hiding tokens the program masked in.

The mask a program's tokenizer made and handed its model in a batch (a `features` dict, a BatchEncoding, a dataclass)
states which positions of that batch's ids are tokens. Where a model call's forward writes a narrower mask back into
the batch it was handed (trace/rewritten.py: another tensor in the field, or the same edited in place, some token
position now 0, the ids untouched), and a later call over the same batch, the same ids, attends with that rewritten
mask, the tokens the rewrite dropped are hidden as keys: nothing the program did between the calls changed what the
batch holds, its model did. Wrong where an attention call of the later model call hides, from every query, each key
the rewrite dropped and is of the batch's rows and positions (huggingface/sentence-transformers#3944: Pooling with
`include_prompt=False` replaced `features["attention_mask"]` with its prompt-excluded pooling mask, so a repeated call
on the same features, AdaptiveLayerLoss's or GradCache's, ran BERT with the prompt's keys masked). Quiet where the
forward rewrote nothing the program marked a token (a cast, a mask that only grows), where the program itself changed
the batch between the calls (a token-dropout augmentation: not the model's doing), where the narrowed mask went to
another field or a local variable (the fix), and where no attention call hides the dropped keys.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _seen(call, rows: int, length: int) -> np.ndarray | None:
    """Keys some query of `call` sees, (rows, length); None where the call is not of those rows and positions."""
    if call.shape[3] != length or call.shape[0] not in (rows, 1):
        return None
    cells = keep(call)
    if cells is None:
        return None
    seen = cells.any(axis=(1, 2))
    return np.broadcast_to(seen, (rows, length)) if seen.shape[0] in (1, rows) else None


def rewritten_attended(run: Run) -> list:
    """The first attention call of each model call that hides the keys a rewrite of its batch's mask dropped."""
    found = []
    for top in run.tops:
        if not top.rewritten:
            continue
        calls = run.made_by(top)
        for rewrite in top.rewritten:
            before, after = rewrite["before"], rewrite["after"]
            dropped = before & ~after
            rows = np.flatnonzero(dropped.any(axis=1))
            hit = None
            for call in calls:
                seen = _seen(call, *before.shape)
                if seen is None or (seen & dropped).any() or not (seen & after)[rows].any(axis=1).all():
                    continue  # (a call that sees a dropped key, or none of a row's kept tokens: not this batch's)
                hit = call
                break
            if hit is None:
                continue
            b = int(rows[0])
            keys = np.flatnonzero(dropped[b])
            others = f" (and row{'s' if len(rows) > 2 else ''} {', '.join(str(int(r)) for r in rows[1:])})" \
                if len(rows) > 1 else ""
            field = rewrite.get("held") or f"{rewrite['batch']}['{rewrite['field']}']"
            found.append((hit, Finding("mask-rewritten-by-forward", (
                f"batch row {b}{others}: keys {spans(keys)} are tokens of the {rewrite['field']} the program handed "
                f"{rewrite['by']} in {rewrite['batch']} (row {b}'s tokens then: {spans(np.flatnonzero(before[b]))}), "
                f"yet {top.where}'s later call over the same ids hides them from every query: the forward of "
                f"{rewrite['by']}'s earlier call (attention calls {rewrite['call']} on) wrote a narrower mask back into "
                f"{field} as it ran, and this call attends with it — a pooling mask written into the model's inputs?"),
                expected=f"row {b}'s keys {spans(np.flatnonzero(before[b]))} seen, as the program's mask states",
                source=f"{field} as the program handed it", cell=(b, 0, int(keys[0])))))
            break
    return found


RULES = (
    Rule("mask-rewritten-by-forward", "wrong", "steps", "a model call over the same batch and ids as an earlier one "
         "attends with the mask that earlier call's own forward wrote back into the batch, hiding keys the program's "
         "mask marks tokens",
         rewritten_attended),
)
