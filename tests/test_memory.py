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


def test_the_cgroup_limit_is_read_once_and_its_usage_on_every_call(monkeypatch, tmp_path):
    v2_limit, v2_usage, v1_limit, v1_usage = (tmp_path / name for name in ("max", "current", "limit_in_bytes", "usage_in_bytes"))
    monkeypatch.setattr(memory, "CGROUP_FILES", ((str(v2_limit), str(v2_usage)), (str(v1_limit), str(v1_usage))))
    v1_limit.write_text("1000000\n")
    v1_usage.write_text("250000\n")  # no v2 files: the v1 pair is read
    memory._cgroup_limit.cache_clear()
    try:
        assert memory._cgroup_left() == 750_000
        v1_usage.write_text("600000\n")
        assert memory._cgroup_left() == 400_000  # the usage moves with the cgroup
        v1_limit.write_text("2000000\n")
        assert memory._cgroup_left() == 400_000  # the limit is the process's, read once
        memory._cgroup_limit.cache_clear()
        assert memory._cgroup_left() == 1_400_000
        v2_limit.write_text("max\n")
        v2_usage.write_text("1\n")
        memory._cgroup_limit.cache_clear()
        assert memory._cgroup_left() is None  # v2 first, and it sets no limit
        v2_limit.write_text("9223372036854771712\n")  # v1's way of writing no limit
        memory._cgroup_limit.cache_clear()
        assert memory._cgroup_left() is None
    finally:
        memory._cgroup_limit.cache_clear()  # the real files again for the tests after this one
