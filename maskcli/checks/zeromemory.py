"""A cross-attention whose real queries see memory positions the program zeroed as padding in the model call's input.

A pipeline that zeroes the padded positions of the text encoder's states before it hands them to its transformer
(diffusers' PixArt-alpha before huggingface/diffusers#5752: `mask_feature` multiplied the T5 states by the
tokenizer's attention mask and called the transformer without `encoder_attention_mask`; imagen-pytorch's
`text_embeds.masked_fill(~text_mask, 0.)`) states in the data which keys are padding: a run of two or more positions
exactly 0 in every channel at the start or the end of a batch row of a float (B, S, C) argument of the model call
(trace/zeromemory.py). A cross-attention of that call over S keys, row for row, whose queries see those keys lets the
image attend what the program itself erased: a zero state under the key and value projections' biases is a key like
any other, so the padding still takes softmax weight. Wrong.

Quiet where the mask hides them (the fix: the tokenizer's mask handed as `encoder_attention_mask`), on a
self-attention (checks/zerokv.py reads its keys), on an argument a self-attention of the same call attends over (the
queries' own input: a zero-padded decoder input beside an encoder's memory as long), where the zeros are one position
alone (a learned null token), a
whole row (an empty prompt's, classifier-free guidance's null condition) or between real positions, and where the
call's keys are not that argument's positions (another length, other batch rows).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import STRONG, Run, cross, crossing, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

RUN = 2
EXTRA = 4  # keys beside the memory's positions: a CLS token, a few register or null tokens concatenated to it


def _edges(zero: np.ndarray) -> np.ndarray:
    """Bool (B, S): the zero positions of each row that make a run of RUN or more at its start or end, in rows that
    hold a position that is not zero."""
    out = np.zeros_like(zero)
    for b, row in enumerate(zero):
        if row.all():
            continue
        start = int(np.argmin(row))  # first non-zero
        end = len(row) - int(np.argmin(row[::-1]))  # one past the last non-zero
        if start >= RUN:
            out[b, :start] = True
        if len(row) - end >= RUN:
            out[b, end:] = True
    return out


def zero_memory_seen(run: Run) -> list:
    """Cross-attention calls whose queries see keys at positions the model call's (B, S, C) input zeroed at a row's
    edge."""
    found, padding, done = [], {}, {}
    # (run.made_by leaves the cross-attention calls out: engine.py; a softmax site that masks nowhere is among the
    # unmasked, and is a cross-attention where the module's word or a memory argument says so: a pooler handed no mask)
    for call in sorted(run.cross + [one for one in run.unmasked if crossing(one).by in STRONG],
                       key=lambda one: one.index):
        top = run.top(call)
        said = None if top is None else top.arguments.get("zero_memory")
        if not said or not cross(call):
            continue
        if id(top) not in padding:  # (an argument whose positions a self-attention of the call attends is the
            # queries' own input, a zero-padded decoder input, not the memory: left alone)
            own = {(c.shape[0], c.shape[2]) for c in run.made_by(top) if c.shape[2] == c.shape[3]}
            padding[id(top)] = [(name, _edges(zero)) for name, zero in said if zero.shape not in own]
        for name, pad in padding[id(top)]:
            if call.shape[0] != pad.shape[0] or not 0 <= call.shape[3] - pad.shape[1] <= EXTRA or not pad.any():
                continue
            key = (call.mask, call.shape, name, id(top))
            if key not in done:
                done[key] = _finding(call, name, pad, top.where)
            if done[key] is not None:
                found.append((call, done[key]))
            break
    return found


def placed(pad: np.ndarray, k_len: int) -> np.ndarray:
    """Bool (B, k_len): the keys that are zero positions of `pad` (B, S) whether the k_len - S keys beside the memory's
    positions (a CLS or register token concatenated to it) come before them or after them. Where both placements
    call a key padding, it is padding whichever the program chose; where they differ, nothing is said."""
    extra = k_len - pad.shape[1]
    if extra == 0:
        return pad
    first, last = np.zeros((pad.shape[0], k_len), bool), np.zeros((pad.shape[0], k_len), bool)
    first[:, extra:], last[:, :pad.shape[1]] = pad, pad
    return first & last


def _finding(call, name: str, pad: np.ndarray, where: str) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, pad.shape[0]):
        return None
    rows = np.broadcast_to(cells.any(axis=1), (pad.shape[0], call.shape[2], call.shape[3]))
    keys = placed(pad, call.shape[3])
    bad = rows & keys[:, None, :]
    if not bad.any():
        return None
    b, q, k = (int(x) for x in np.argwhere(bad)[0])
    zeros = [int(x) for x in np.flatnonzero(pad[b])]
    extra = call.shape[3] - pad.shape[1]
    beside = "" if not extra else (
        f" (its {call.shape[3]} keys are those {pad.shape[1]} positions and {extra} more, a CLS or register token "
        f"concatenated to them: keys {spans([int(x) for x in np.flatnonzero(keys[b])])} are padding whether it comes first or last)")
    source = f"{name} of {where}"
    return Finding("zero-memory-seen", (
        f"batch row {b}: query {q} sees memory key {k}, one of positions {spans(zeros)} that the model call's {name} "
        f"holds as exactly 0 in every channel (the program zeroed them as padding){beside}, and {int(bad.sum())} "
        f"such cells are kept: a zero state under the projections' biases is still a key, so the padding takes "
        f"weight (the padding mask never reached the cross-attention?)"),
        expected=f"memory positions {spans(zeros)} of batch row {b} hidden", source=source, cell=(b, q, k))


RULES = (
    Rule("zero-memory-seen", "wrong", "steps", "a cross-attention whose queries see memory positions the program "
         "zeroed as padding in the model call's (B, S, C) input (diffusers#5752: PixArt's mask_feature zeroed the "
         "padded T5 states and called the transformer without encoder_attention_mask)", zero_memory_seen),
)
