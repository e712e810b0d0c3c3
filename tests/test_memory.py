"""The memory guard and how sizes are written."""

from __future__ import annotations

import pytest

from maskcli import memory
from maskcli.errors import MaskError


@pytest.mark.parametrize("count, text", [(0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"),
                                         (3 * 1024**3, "3.0 GiB"), (2**60, "1024.0 PiB")])
def test_format_bytes(count, text):
    assert memory.format_bytes(count) == text


def test_check_dense_fits_names_the_shape_the_need_and_the_fix(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 100)
    with pytest.raises(MaskError) as error:
        memory.check_dense_fits((2, 3, 4, 5), 1, "as a bool tensor", fix="use less")
    assert str(error.value) == (
        "the dense mask 2 x 3 x 4 x 5 would need 120 bytes (120 bytes) as a bool tensor, but only 100 bytes is free: use less"
    )
    memory.check_dense_fits((2, 5, 10), 1, "fits")
