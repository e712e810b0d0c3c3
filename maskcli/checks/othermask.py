"""padding-unmarked's cause where the attention_mask a model call was handed is another input's.

A mask that marks a row's pad tokens real was often made for other ids: the call before it, of the same model, ran with
exactly this mask and ids whose padding it fits (a 0 exactly where those ids are at the pad id), and this call's ids
differ. The mask was carried over from that input (PixArt-sigma d5adc75: the null prompt "" encoded with
`txt_tokens.attention_mask`, the last validation prompt's, so its pad tokens were attended). checks/tokens.py says it
in its padding-unmarked finding instead of its generic cause.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, Top


def borrowed(run: Run, top: Top, ids: np.ndarray, given: np.ndarray, pad_id: int) -> str | None:
    """Why `given` marks `top`'s pad tokens real, where it is the mask of an earlier call of the same model whose own
    ids it fits and whose ids are not these; None where no earlier call was handed it."""
    at = next((i for i, one in enumerate(run.tops) if one is top), 0)
    for other in reversed(run.tops[:at]):
        if other.where != top.where:
            continue
        mask, own = other.arguments.get("attention_mask"), other.arguments.get("input_ids")
        if not isinstance(mask, np.ndarray) or not isinstance(own, np.ndarray) or mask.shape != given.shape \
                or own.shape != ids.shape or np.array_equal(own, ids) or not np.array_equal(mask, given):
            continue
        if ((own == pad_id) == (mask == 0)).all():
            calls = f"attention calls {other.first}-{other.end - 1}" if other.end - other.first > 1 else \
                f"attention call {other.first}"
            return (f"the mask is the one an earlier call of {top.where} ({calls}) ran with other input_ids, whose "
                    f"padding it fits: another input's attention_mask, carried over")
    return None
