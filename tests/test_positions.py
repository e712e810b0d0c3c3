"""Where queries and keys sit: the rules of --len, --offset, --kv-start, --kv-len and --align."""

from __future__ import annotations

import pytest

from maskcli.errors import MaskError
from maskcli.positions import DEFAULT_LEN, resolve


def place(**given):
    options = dict(length=None, offset=None, kv_start=None, kv_len=None, align=None, sequence=None, queries=None)
    return resolve(**{**options, **given})


def test_defaults_and_what_the_data_says():
    assert place() == (0, DEFAULT_LEN, 0, DEFAULT_LEN)
    assert place(sequence=("labels", 6)) == (0, 6, 0, 6)  # labels cover 0..5: six queries over six keys
    assert place(sequence=("labels", 6), offset=4) == (4, 2, 0, 6)  # the last two are new, four are cached
    assert place(queries=3, offset=5) == (5, 3, 0, 8)  # a draft tree of three tokens
    assert place(length=2, default=5) == (0, 2, 0, 2)
    assert place(default=5) == (0, 5, 0, 5)


def test_cache_offsets_and_kv_windows():
    assert place(length=2, offset=4) == (4, 2, 0, 6)  # prefill: keys 0..5
    assert place(length=1, offset=9, kv_start=6) == (9, 1, 6, 4)  # a sliding cache kept keys 6..9
    assert place(length=3, kv_len=8) == (0, 3, 0, 8)  # a static cache: top-left
    assert place(length=3, kv_len=8, align="top-left") == (0, 3, 0, 8)
    assert place(length=3, kv_len=8, align="bottom-right") == (5, 3, 0, 8)  # FlashAttention's causal
    assert place(length=3, kv_len=8, kv_start=2) == (2, 3, 2, 8)  # query 0 faces the first key kept
    assert place(length=4, kv_len=10, offset=1) == (1, 4, 0, 10)  # cross-attention memory, placed by hand


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"length": 0}, "--len must be at least 1"),
        ({"offset": -1}, "--offset must be at least 0"),
        ({"length": 1 << 41}, "too large"),
        ({"align": "middle", "kv_len": 3}, "unknown --align 'middle'"),
        ({"align": "top-left"}, "without --kv-len"),
        ({"align": "top-left", "offset": 1, "kv_len": 3}, "not both"),
        ({"kv_start": 4, "length": 4}, "--kv-start 4 leaves no key"),
        ({"sequence": ("labels", 3), "offset": 3}, "labels give 3 positions, none left for a query after --offset 3"),
        ({"queries": 4, "length": 3}, "does not match the 4 draft tokens"),
        ({"length": 5, "kv_len": 3, "align": "bottom-right"}, "position -2"),
    ],
)
def test_bad_positions_say_what_to_fix(given, says):
    with pytest.raises(MaskError, match=says):
        place(**given)


def test_a_frames_query_column_is_its_positions_made_once_and_read_only():
    import numpy as np

    from maskcli.positions import Frame

    frame = Frame(3, 4, 0, 7)
    column = frame.q_column
    assert column.shape == (1, 4, 1) and column[0, :, 0].tolist() == [3, 4, 5, 6] and column.dtype == np.int64
    assert frame.q_column is column and not column.flags.writeable
