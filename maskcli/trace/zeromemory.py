"""A model call's memory input whose padding the program zeroed: the rows of a float (B, S, C) argument that are
exactly 0 in every channel, read where a batch row starts or ends with such rows (checks/zeromemory.py).

A text-to-image or text-to-video pipeline hands its transformer the text encoder's states as the cross-attention's
memory; one that zeroes the padded positions (diffusers' PixArt `mask_feature`: `emb * mask[:, None, :, None]`,
imagen-pytorch's `text_embeds.masked_fill(~mask, 0.)`) states which keys are padding in the data itself. Only an
argument one of whose rows has an exactly-zero first or last position is read whole (two comparisons a call where
none is: most inputs).
"""

from __future__ import annotations

import torch

from maskcli.trace.padded import MOST

RUN = 2  # zero positions in a row at an edge read as padding (one alone may be a learned null token)


def zero_memory(given: dict) -> dict:
    """{"zero_memory": ((name, bool (B, S) rows exactly 0), ...)} for each float (B, S, C) argument of the call with
    a run of RUN or more zero positions at the start or end of some batch row; {} where there is none."""
    found = []
    for name, value in given.items():
        if not issubclass(type(value), torch.Tensor) or value.dim() != 3 or not value.is_floating_point() \
                or value.shape[1] < RUN + 1 or value.numel() > MOST or value.device.type == "meta":
            continue
        data = value.detach()
        if not bool((data[:, -1] == 0).all(-1).any() | (data[:, 0] == 0).all(-1).any()):
            continue
        zero = (data == 0).all(-1).cpu().numpy()  # (B, S)
        edge = zero[:, :RUN].all(axis=1) | zero[:, -RUN:].all(axis=1)
        if (edge & ~zero.all(axis=1)).any():  # (a row zero throughout is no padding: an empty prompt's, a null input)
            found.append((name, zero))
    return {"zero_memory": tuple(found)} if found else {}
