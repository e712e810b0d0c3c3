"""Token ids the program holds, with the pad id its module states, placed among the keys of the layer they reach.

A model that joins several token groups into one sequence (pi-zero's images, language and actions) builds the
language's key-padding mask by hand, padding `ids != pad_id` out to the joined length: where it lands among the keys
is the program's arithmetic. What it states, read here at a call whose frames hold padding (trace/queried.py): a
function on the stack whose `self` module holds an int pad id as an attribute (`pad_id`, `lm_pad_id`,
`pad_token_id`, `pad_idx`) and, as a local, 2-D integer ids with that id in some rows and not others; the module's
token embedding (an nn.Embedding it owns) looks the real ids up, and those vectors found in the attending layer's
first input, (B, N, D), or in a tensor of that shape the same function holds (the input before the layer normed it),
at one offset o (the same for every row, each real token's vector exactly), place the ids at tokens o .. o + T of
the N the layer was handed (the layer that gets the embeddings as they are: the first). checks/placedpads.py reads
the mask there, the N first or last among the keys. The program's values are read, never changed.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import torch

from maskcli.trace.held import FRAMES, MOST, program_frames

PAD_ID = re.compile(r"(?:^|_)pad(?:_token)?_(?:id|idx)$")


def placed_ids(first: torch.Tensor | None) -> dict | None:
    """{"ids", "pad", "offset", "width", "name", "where"} where the program's ids sit in the layer's (B, N, D) input
    `first`, or in a tensor of that shape the function holding the ids holds (the input before the layer normed it
    in place of its argument): offset among those N tokens, `width` N."""
    if first is None or not first.is_floating_point() or first.device.type == "meta" or first.numel() > MOST * 64:
        return None
    for frame in program_frames(sys._getframe(1), FRAMES):
        owner = frame.f_locals.get("self")
        if not isinstance(owner, torch.nn.Module):
            continue
        pads = {v for k, v in vars(owner).items() if PAD_ID.search(k) and type(v) is int}
        if len(pads) != 1:
            continue
        pad, variables = pads.pop(), frame.f_locals
        inputs = [first, *(v for v in variables.values() if issubclass(type(v), torch.Tensor) and v is not first
                           and v.shape[:2] == first.shape[:2] and v.dim() == 3 and v.is_floating_point())]
        for name, value in variables.items():
            placed = _placed(owner, value, pad, inputs)
            if placed is not None:
                code = frame.f_code
                return {**placed, "pad": pad, "width": int(first.shape[1]), "name": name,
                        "where": f"{code.co_name}() of {type(owner).__name__}"}
    return None


def _placed(owner, value, pad: int, inputs: list) -> dict | None:
    """{"ids", "offset"} where `value` is (B, T) ids padded with `pad` whose real tokens' embeddings sit in one of
    `inputs` ((B, N, D) each) at one offset."""
    first = inputs[0]
    if not issubclass(type(value), torch.Tensor) or value.dim() != 2 or value.is_floating_point() \
            or value.dtype == torch.bool or value.shape[0] != first.shape[0] or not 1 < value.shape[1] < first.shape[1] \
            or value.numel() > MOST:
        return None
    ids = value.detach().cpu()
    padded = (ids == pad).any(dim=1)
    if not padded.any() or padded.all():
        return None
    real = ids != pad
    width = ids.shape[1]
    for table in (m for m in owner.modules() if isinstance(m, torch.nn.Embedding)):
        weight = table.weight.detach().cpu()
        if weight.shape[1] != first.shape[2] or int(ids[real].min()) < 0 or int(ids[real].max()) >= weight.shape[0]:
            continue
        looked = weight[ids.clamp(0, weight.shape[0] - 1)][real]  # the real tokens' vectors
        row, token = (int(i) for i in real.nonzero()[0])  # (the first real token: where it sits says the offset)
        for tokens in inputs:
            tokens = tokens.detach().cpu()
            if tokens.dtype != weight.dtype:
                continue
            for at in (tokens[row] == weight[ids[row, token]]).all(dim=-1).nonzero().flatten().tolist():
                offset = at - token
                if 0 <= offset <= tokens.shape[1] - width and torch.equal(tokens[:, offset:offset + width][real], looked):
                    return {"ids": ids.numpy().astype(np.int64), "offset": offset}
    return None
