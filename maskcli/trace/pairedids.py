"""Whether a held decoder mask goes with other tokens than the ones a model call was handed.

HF pairs `decoder_attention_mask` with `decoder_input_ids`: a function that holds both, of one shape, states which
tokens its mask describes. A call handed decoder ids that are not those (neither the same tensor nor, over the columns
they share, the same values from the start or from the end: a decode step's last token; a step's columns that every row
of the held ids holds alike, a start token, match any loop's) runs another sequence
(a greedy loop's own tokens beside a training batch's mask), so that mask says nothing of the call's padding
(trace/tops.py's `_withheld`, read by checks/withheld.py; trace/held.py's padding at an attention call, where the
function nearer the call holds the ids it runs: checks/held.py).
"""

from __future__ import annotations

import sys

import torch

PAIRS = {"decoder_attention_mask": "decoder_input_ids"}


def other_tokens(name: str, mask, holder: dict, given: dict) -> bool:
    """True where `holder` (the frame's variables, or the dict that holds the mask) holds the mask's paired ids of
    its shape and the call's ids of that name disagree with them."""
    pair = PAIRS.get(name)
    ids, handed = (holder.get(pair), given.get(pair)) if pair else (None, None)
    if not all(issubclass(type(t), torch.Tensor) for t in (ids, handed)) or handed is ids \
            or ids.shape != mask.shape or handed.dim() != 2 or handed.shape[0] != ids.shape[0]:
        return False
    ids, handed = ids.detach().cpu(), handed.detach().cpu()
    width, w = ids.shape[1], handed.shape[1]
    if w >= width:
        return not torch.equal(handed[:, :width], ids)
    return not any(torch.equal(handed, part) and not _every_row_alike(part) for part in (ids[:, :w], ids[:, width - w:]))


def _every_row_alike(columns: torch.Tensor) -> bool:
    """Every row holds the same tokens in these columns (a batch's start token, a pad column): a decode step's ids
    equal to them say nothing of which sequence it runs (every greedy loop starts with the start token)."""
    return columns.shape[0] > 1 and bool((columns == columns[:1]).all())


def between(holder) -> list:
    """(frame, None) of every frame between the running call and the `holder` frame, innermost first, a library's too:
    the model's own forward (T5ForConditionalGeneration's) holds the decoder ids it runs, inside `generate()` or a
    greedy loop the program wrote beside a training batch's mask."""
    frames, frame = [], sys._getframe(1)
    while frame is not None and frame is not holder:
        frames.append((frame, None))
        frame = frame.f_back
    return frames if frame is holder else []


def inner_other(name: str, mask, holder: dict, inner: list) -> bool:
    """other_tokens against the paired ids the function nearest the attention call holds (`inner`: (frame, names)
    pairs, innermost first, of the functions between that call and the holder: between()): read only where a held mask of a
    paired name was found, so the frames' variables are asked rarely."""
    pair = PAIRS.get(name)
    for frame, _ in inner:
        ids = frame.f_locals.get(pair)
        if issubclass(type(ids), torch.Tensor):
            return other_tokens(name, mask, holder, {pair: ids})
    return False
