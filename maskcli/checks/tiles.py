"""The memory keys a model call's image input holds as padding: tiles (or images) that are exactly 0 throughout.

A vision-language model whose text cross-attends its images' tokens (Llama 3.2 Vision, torchtune's DeepFusionModel)
is handed the images as tiles, (B, [images,] tiles, C, H, W), padded to the batch's most tiles with zeros (torchtune's
padded_collate_tiled_images_and_mask, `F.pad(image, ..., value=0)`); the encoder makes the same number of tokens of
every tile, so the cross-attention's K keys are the U tiles of each row in order, K / U keys each. trace/tiles.py reads
which tiles are exactly 0 in every pixel (a normalised image never is): those tiles' keys are padding, and a text
query that attends the image may see none of them (torchtune#1836: CLIPImageTransform padded the tiles before the mask
counted them, so the mask called the padding tiles real). checks/memory.py reads this where the model call states no
memory padding of its own.

Read only where every row's first tile holds some pixel, some tile of some row is zero, K is a multiple of the tile
count, and every way the input's axes split into tiles that divides K calls the same keys padding.
"""

from __future__ import annotations

import numpy as np

from maskcli.text import spans


def tile_padding(top, rows: int, k_len: int) -> tuple[np.ndarray, str] | None:
    """(bool (rows, k_len) real memory keys, what says it) where the model call's image input holds zero tiles over
    exactly the call's keys (module docstring); None otherwise."""
    found = []
    for name, splits in top.arguments.get("zero_tiles", ()):
        for units, zero in splits:
            if units > k_len or k_len % units or zero.shape[0] not in (1, rows) or zero[:, 0].any():
                continue
            padded = np.repeat(np.broadcast_to(zero, (rows, units)), k_len // units, axis=1)
            found.append((padded, name, units, zero))
    if not found or any(not np.array_equal(each[0], found[0][0]) for each in found[1:]):
        return None
    padded, name, units, zero = found[0]
    b = int(np.flatnonzero(zero.any(axis=1))[0])
    tiles = np.flatnonzero(zero[b]).tolist()
    return ~padded, (f"`{name}` given to {top.where} ({units} tiles of {k_len // units} keys each; tiles {spans(tiles)} "
                     f"of batch row {b} exactly 0 in every value: the batch's padding)")
