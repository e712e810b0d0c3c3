"""A padding mask the model takes, held by the function that called it under that very name, and never handed over.

A model's forward that takes a `*_mask` parameter (`frame_mask`, `image_mask`, `audio_mask`) says it masks the
padding that mask marks; the function of the program that called it holding a tensor of that name (a variable, or a
batch dict's key: `batch["frame_mask"]`) says this batch has such padding (trace/tops.py reads it where the call
left the parameter at None). Where it holds padding (a 0/1 mask, some row padded, some not) and no attention call of
that model call keeps a padded row's real queries from its padding (over the call's own keys; where the mask is over
frames that become several tokens each, a padded row's last query sees every key), the padding was
built, the model asks for it, and it was dropped on the way: KempnerForge#131, the video clips' `frame_mask` the
training step never passed, so the blank frames' tokens were attended.

Quiet where the model call was handed the mask, where any of its calls masks a key of a padded row (the padding
reached the attention some other way), and where the held mask pads no row or every row.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

PADDING = re.compile(r"pad(?:ding)?_mask$")
ATTENTION = re.compile(r"attention_mask$")  # (trace/tops.py DECODER_MASK: 1 = attend, 0 = padding, in every row)


def withheld(run: Run) -> list:
    """Model calls that left a `*_mask` parameter at None whose caller holds that mask with padded rows, none of whose
    attention calls masks a key of those rows."""
    found = []
    for top in run.tops:
        held = top.arguments.get("withheld")
        if not held:
            continue
        name, where, rows = held[0], held[1], np.asarray(held[2])
        real = ~rows.astype(bool) if PADDING.search(name) else rows.astype(bool)  # (key_padding_mask: True = padding)
        padded = [b for b in range(len(real)) if not real[b].all()]
        if not padded or len(padded) == len(real) and not ATTENTION.search(name) or not real.any(axis=1).all():
            continue  # (an attention mask's 0s are padding whatever the other rows hold: a batch of one is padded)
        calls = [call for call in run.calls if top.first <= call.index < top.end and run.top(call) is top]
        if not calls or any(not _padding_seen(call, real, padded, bool(ATTENTION.search(name))) for call in calls):
            continue
        b = padded[0]
        finding = Finding("mask-withheld", (
            f"the model's forward takes `{name}`, and {where} holds `{name}` ({rows.shape[0]} x {rows.shape[1]}, "
            f"batch row {b} padded at {', '.join(str(int(i)) for i in np.flatnonzero(~real[b])[:6])}), but the call "
            f"left it at None and no attention call keeps that padding from the row's queries: it is attended"),
            expected=f"{name} handed to the model call", source=f"{name} in {where}")
        found.extend((call, finding) for call in calls)
    return found


def _padding_seen(call, real: np.ndarray, padded: list, tokens: bool = False) -> bool:
    """The call masks none of the held padding: where the mask is over the call's keys, some real query of a padded
    row sees a key it calls padding (causal order alone hides right padding: quiet there); else (frames expanded into
    tokens somewhere among the keys) each padded row's last query sees every key. True also where the call cannot be
    read (no mask stored: every key seen). False where no padded row is one of the call's rows, and where the call
    has fewer rows than the mask (a reference run of one row beside the padded batch's mask)."""
    if call.stored is None:
        return True
    if call.shape[0] < real.shape[0]:
        return False  # (a call over fewer rows than the held mask: another batch, a row run alone beside it)
    cells = keep(call)
    if cells is None:
        return False  # (too big to read: said nothing of)
    rows = cells.shape[0]
    if tokens:  # an attention mask: one column per key token, the call's first keys (never frames expanded); a call
        # over fewer keys than it has columns attends another sequence (generate's own decoder tokens beside a
        # training batch's decoder_attention_mask): nothing of it is said
        width, q_len, k_len = real.shape[1], call.shape[2], call.shape[3]
        if width > k_len or q_len == k_len != width:
            return False
        inside = [b for b in padded if b < call.shape[0]]
        return bool(inside) and all(
            (cells[b if rows > 1 else 0, :, :, :width] & ~real[b][None, None, :]
             & (real[b][None, :, None] if q_len == k_len else True)).any() for b in inside)
    if real.shape[1] == call.shape[3] == call.shape[2]:
        return any((cells[b if rows > 1 else 0].any(axis=0) & real[b][:, None] & ~real[b][None, :]).any()
                   for b in padded if b < call.shape[0])
    inside = [b for b in padded if b < call.shape[0]]  # (none: a call over another batch, an unpadded reference run
    # of one row beside the padded batch's mask, says nothing of that mask's padding)
    return bool(inside) and all(cells[b if rows > 1 else 0, :, -1, :].all() for b in inside)


RULES = (
    Rule("mask-withheld", "wrong", "steps", "a `*_mask` the model's forward takes, held under that name by the function "
         "that called it (a variable, a batch dict's key) with padded rows, left at None, and no attention call masks "
         "those rows' keys (KempnerForge's video frame_mask)", withheld),
)
