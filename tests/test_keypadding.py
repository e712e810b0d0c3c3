"""maskcli.keypadding: the flags of a key padding (property tests against maskcli show's own --lengths/--pad/--ids),
and the one rule that names, --expect and assert_mask share, against a double loop."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from maskcli.keypadding import of, options, read, valid
from maskcli.mask import MaskOptions, build


def rows(draw_kind: str, lengths: list[int], width: int, bits: list[list[bool]]) -> np.ndarray:
    columns = np.arange(width)[None, :]
    lengths = np.array(lengths)[:, None]
    if draw_kind == "right":
        return columns < lengths
    if draw_kind == "left":
        return columns >= width - lengths
    return np.array(bits, dtype=bool)


@st.composite
def paddings(draw):
    batch, width = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["right", "left", "any"]))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    bits = draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=batch, max_size=batch))
    return rows(kind, lengths, width, bits)


@given(paddings())
def test_the_flags_rebuild_the_real_keys_in_maskcli_and_read_back(real):
    found = options(real)
    batch, width = real.shape
    assert np.array_equal(valid(found, batch, width), real)
    # maskcli's own padding kind, built from these flags: a real key is one every query may see
    built = build("full", MaskOptions(length=width, **found)).dense()
    assert np.array_equal(built[:, 0, -1, :], real)
    prefix = all(row[: row.sum()].all() for row in real)
    suffix = all(row[width - row.sum():].all() for row in real)
    assert ("lengths" in found) == (prefix or suffix) and (found.get("pad") == "left") == (suffix and not prefix)


@given(st.lists(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=3, max_size=3), min_size=1, max_size=3))
def test_read_is_the_keys_a_batch_row_never_sees_that_another_row_does(cells):
    keep = np.array(cells, dtype=bool)[:, None]  # (B, 1, 3, 5)
    found = read(keep)
    batch, width = keep.shape[0], keep.shape[-1]
    padded = np.zeros((batch, width), dtype=bool)
    for b in range(batch):  # a double loop: key j of row b, seen by no query of row b and by some query of another
        for j in range(width):
            padded[b, j] = not keep[b, 0, :, j].any() and any(keep[o, 0, :, j].any() for o in range(batch) if o != b)
    assert found == ({} if not padded.any() else options(~padded))


def test_stated_padding_wins_then_the_calls_argument_then_the_mask():
    keep = np.ones((2, 1, 2, 3), dtype=bool)
    keep[1, ..., 2] = False
    assert of(keep) == {"lengths": "3,2"}
    assert of(keep, given={}) == {}  # the call had a key-padding argument and passed none
    assert of(keep, given={"lengths": "3,1"}) == {"lengths": "3,1"}
    assert of(keep, given={"lengths": "3,1"}, stated={"ids": "1,1,1;1,1,1"}) == {}
