"""A prompt mask handed to one call of a text-conditioned model and left off another call of it, whose prompt is padded.

A pipeline calls its model more than once a step (classifier-free guidance: the prompt's call and the negative
prompt's, each with its own T5 hidden states padded to the same T tokens); the mask of each prompt goes with its own
call. What the program states (trace/textheld.py): a call of the model handed a (B, T) prompt mask says this module
masks its prompt of T tokens; a call of the same module handed a prompt of (B, T) and no mask, while the function
that made it holds a (B, T) 0/1 mask with padding (some row's tokens 0) that is none of the masks the module's calls
were handed, left that prompt's mask off. Where none of that call's attention calls keeps the mask's padded prompt
keys from a query of their row, wherever the T prompt tokens sit among its keys (before or after the image's in a
joint attention, or all its keys in a cross-attention), they are attended: SimpleTuner 295decc9b, Flux's true-CFG
unconditional call handed no attention_mask while the pipeline held `negative_mask`.

Quiet where every call of the module was handed its mask, where the held mask is one some call was handed (a
reference run beside it), where the caller holds two different unhanded masks (which is the call's is not stated),
where no call of the module was handed a mask of that shape, and where an attention call of the call hides the padding.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def prompt_mask_left_off(run: Run) -> list:
    """Model calls handed their prompt with no mask, whose caller holds an unhanded padded mask of it that a sibling
    call's mask shape vouches for, none of whose attention calls hides that padding."""
    handed: dict = {}
    for top in run.tops:
        given = top.arguments.get("text_mask")
        if given:
            rows = np.asarray(given[1]).astype(bool)
            handed.setdefault((top.where, rows.shape, given[2]), []).append(rows)
    found = []
    for top in run.tops:
        held = top.arguments.get("text_held")
        siblings = handed.get((top.where, tuple(held[1]), held[3])) if held else None
        if not siblings:
            continue
        masks = {np.asarray(rows).astype(bool).tobytes(): (name, where, np.asarray(rows).astype(bool))
                 for name, where, rows in held[2]}
        left = [m for key, m in masks.items() if not any(s.tobytes() == key for s in siblings)]
        if len(left) != 1:
            continue
        name, where, real = left[0]
        calls = [c for c in (*run.calls, *run.cross, *run.unmasked)
                 if top.first <= c.index < top.end and run.top(c) is top]
        seen = [(call, _seen(call, real)) for call in sorted(calls, key=lambda c: c.index)]
        seen = [(call, cells) for call, cells in seen if cells is not None]  # (keys too few for the prompt: another
        # attention of the model, an image-only one)
        if not seen or any(not cells.any() for _, cells in seen):
            continue
        call, cells = seen[0]
        b, q, k = first_cell(cells)
        pads = [int(real.shape[1] - r) for r in real.sum(axis=1)]
        found.append((call, Finding("prompt-mask-left-off", (
            f"{top.where} was handed its prompt ({real.shape[0]} x {real.shape[1]} tokens) and no {held[0]}, where "
            f"the same function's other calls of it were handed one of that shape; {where} holds `{name}`, a mask of "
            f"that shape none of them was handed, which calls {pads} of its tokens padding a row: query {q} of batch "
            f"row {b} sees padded prompt key {k}, and none of the call's {len(seen)} attention calls over it hides "
            f"that padding"),
            expected=f"`{name}` handed to the call as {held[0]}", source=f"{name} in {where}", cell=(b, q, k))))
    return found


def _seen(call, real: np.ndarray) -> np.ndarray | None:
    """Bool (B, Lq, Lk): queries that see a key the mask calls padding, with the T prompt tokens at the keys' front
    and at their end alike (a cross-attention's keys are the prompt's); None where the keys cannot hold the prompt or
    the mask cannot be read (a call over other rows)."""
    rows, length = real.shape
    batch, q_len, k_len = int(call.shape[0]), int(call.shape[2]), int(call.shape[3])
    if batch != rows or k_len < length:
        return None
    if call.stored is None:
        cells = np.ones((rows, q_len, k_len), dtype=bool)
    else:
        kept = keep(call)
        if kept is None or kept.shape[0] not in (1, rows):
            return None
        cells = np.broadcast_to(kept.any(axis=1), (rows, q_len, k_len))
    seen = []
    for start in sorted({0, k_len - length}):
        padded = np.zeros((rows, k_len), dtype=bool)
        padded[:, start:start + length] = ~real
        seen.append(cells & padded[:, None, :])
    return seen[0] if all(s.any() for s in seen) else np.zeros_like(cells)  # (hidden at one place: kept to)


RULES = (
    Rule("prompt-mask-left-off", "wrong", "steps", "a call of a text-conditioned model handed its prompt and no mask "
         "while its caller holds that padded prompt's mask and another call of the model was handed one (a true-CFG "
         "unconditional call)", prompt_mask_left_off),
)
