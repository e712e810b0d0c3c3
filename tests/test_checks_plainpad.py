"""checks/plainpad.py: a plain mask read as the batch's padding where the ids beside it hold one id at its 0s."""

from __future__ import annotations

import numpy as np

from maskcli.checks.plainpad import ids_padding


def _left(lengths, width, pad=0):
    ids = np.full((len(lengths), width), pad)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = np.arange(1, n + 1) + 10 * row + pad + 1
    return ids


def test_left_padding_at_the_pad_id_is_read_as_long_or_one_longer():
    ids = _left([6, 3, 4], 6, pad=2)
    mask = (ids != 2).astype(np.int64)
    assert ids_padding(mask, ids)
    assert ids_padding(mask[:, :-1], ids)  # (an autoregressive wrapper's inputs: x[:, :-1])
    right = ids[:, ::-1].copy()
    assert ids_padding((right != 2).astype(np.int64), right)


def test_a_prompt_loss_mask_over_varied_ids_is_not_padding():
    ids = np.array([[3, 17, 8, 22, 5, 11, 19], [9, 4, 31, 25, 7, 30, 16], [12, 6, 27, 14, 13, 28, 10]])
    mask = np.array([[0] * 5 + [1] * 2, [0] * 3 + [1] * 4, [0] * 4 + [1] * 3])
    assert not ids_padding(mask, ids)


def test_what_is_not_read():
    ids = _left([6, 3, 4], 6, pad=2)
    mask = (ids != 2).astype(np.int64)
    assert not ids_padding(mask, None)
    assert not ids_padding(mask, ids[:, :-2])  # (ids shorter than the mask)
    assert not ids_padding(np.ones_like(mask), ids)  # no padding
    one = np.array([[0, 1, 1], [0, 1, 1]])  # one token at every row's start: a BOS a loss mask skips
    assert not ids_padding(one, np.array([[1, 5, 6], [1, 7, 8]]))
    holed = mask.copy()
    holed[0, 3] = 0  # a 0 inside a row: not one run at its edge
    assert not ids_padding(holed, ids)
    other = ids.copy()
    other[1, 0] = 3  # the 0s not all one id
    assert not ids_padding(mask, other)


def test_a_mask_named_for_its_input_is_that_input_padding_even_where_every_row_is_padded():
    from maskcli.checks.plainpad import named_padding

    boxes = [[[1, 2, 3, 4]] * 0 + [[9, 9, 9, 9]] * 2 + [[1, 2, 3, 4], [5, 6, 7, 8]],
             [[9, 9, 9, 9]] + [[1, 1, 2, 2], [3, 3, 4, 4], [2, 2, 5, 5]]]
    mask = np.array([[0, 0, 1, 1], [0, 1, 1, 1]])
    ids = np.unique(np.array(boxes).reshape(8, 4), axis=0, return_inverse=True)[1].reshape(2, 4)
    said = named_padding({"input_mask_of": ("input_boxes_mask", "input_boxes", mask, ids)}, 2, 4)
    assert said is not None and (said[0] == (mask == 1)).all()
    assert not ids_padding(mask, ids)  # (a plain mask must leave some row unpadded)
    loss = np.array([[0, 0, 1, 1], [0, 0, 0, 1]])  # 0s over varied boxes: no padding
    assert named_padding({"input_mask_of": ("input_boxes_mask", "input_boxes", loss, ids)}, 2, 4) is None
    assert named_padding({}, 2, 4) is None
