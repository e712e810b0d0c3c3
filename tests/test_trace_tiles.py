"""trace/tiles.py: the units of a model call's float input that are exactly 0, against a loop over them."""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.tiles import zero_units


def test_zero_tiles_of_a_dict_argument_read_as_a_loop_reads_them():
    rng = np.random.default_rng(0)
    images = rng.standard_normal((2, 1, 4, 3, 2, 2)).astype(np.float32)
    images[0, 0, 1:] = 0  # 3 padding tiles of row 0
    images[1, 0, 3] = 0
    images[1, 0, 2, 1] = 0  # a channel of a tile: not a whole tile
    [(name, splits)] = zero_units({"encoder_input": {"images": torch.from_numpy(images)}})["zero_tiles"]
    assert name == "encoder_input['images']"
    loop = [[all(v == 0 for v in images[b, 0, t].flatten()) for t in range(4)] for b in range(2)]
    by_units = dict(splits)
    assert by_units[4].tolist() == loop
    assert zero_units({"x": torch.ones(2, 4, 3, 2, 2)}) == {}  # nothing zero
    whole = images.copy()
    whole[1] = 0  # a row all zero: no padded batch
    assert 4 not in dict(zero_units({"x": torch.from_numpy(whole)}).get("zero_tiles", (("x", ()),))[0][1])
