"""Which units of a model call's float input (the tiles of its images, an image of several) are exactly 0 throughout:
a batch's padding, as a collate pads images to the batch's most tiles (`F.pad(image, ..., value=0)`, torchtune's
padded_collate_tiled_images_and_mask and CLIPImageTransform's pad_max_tiles), kept for checks/tiles.py.

An argument (or a value of a dict argument: torchtune's `encoder_input={"images": ...}`) that is a float tensor of
four axes at least, (B, units..., features...) with two feature axes at least (a tile's (C, H, W), a flattened
tile's (patches, dim)): for each way its axes split into units and features, the units of each row that are exactly
0 in every feature. A normalised image is never exactly 0 over a whole tile (that is a raw value of exactly the
mean, which no 8-bit pixel has). Kept only where some unit is zero and no row is all zero.
"""

from __future__ import annotations

import numpy as np
import torch

MOST = 1 << 24  # elements of one argument read (an image batch; never kept, only its (B, units) zeros)


def zero_units(given: dict) -> dict:
    """{"zero_tiles": ((name, ((units, bool (B, units)), ...)), ...)}: see the module's docstring."""
    found = []
    for name, value in given.items():
        values = value.items() if isinstance(value, dict) else ((None, value),)
        for key, each in values:
            read = _splits(each)
            if read:
                found.append((name if key is None else f"{name}[{key!r}]", read))
    return {"zero_tiles": tuple(found)} if found else {}


def _splits(value) -> tuple:
    if not issubclass(type(value), torch.Tensor) or not value.is_floating_point() or value.dim() < 4 \
            or value.numel() > MOST or value.numel() == 0 or value.device.type == "meta":
        return ()
    zero = value.detach() == 0
    if not zero.any():
        return ()
    found = []
    for split in range(2, value.dim() - 1):  # units: axes 1..split-1; features: the rest (two at least)
        units = zero.flatten(split).all(dim=-1).flatten(1).cpu().numpy()
        if units.any() and not units.all(axis=1).any() and units.shape[1] > 1:
            found.append((int(units.shape[1]), units))
    return tuple(found)
