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


def _cgroup_tree(tmp_path, lines, files):
    tmp_path.mkdir(parents=True)
    (tmp_path / "cgroup").write_text("\n".join(lines) + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_cgroup_limits_are_read_where_this_process_is_and_above_it(tmp_path):
    from maskcli.memory import _cgroup_left

    # v1: the root holds no limit; this process's cgroup 2 GiB (1 used), its parent 8 GiB (7.5 used): 0.5 GiB left
    proc, mount = _cgroup_tree(tmp_path / "v1", ["4:memory:/jobs/mine", "0::/"], {
        "memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": str(50 * 2**30),
        "memory/jobs/memory.limit_in_bytes": str(8 * 2**30), "memory/jobs/memory.usage_in_bytes": str(int(7.5 * 2**30)),
        "memory/jobs/mine/memory.limit_in_bytes": str(2 * 2**30), "memory/jobs/mine/memory.usage_in_bytes": str(2**30),
    })
    assert _cgroup_left(proc, mount) == 2**29
    # v2: the process's own folder
    proc, mount = _cgroup_tree(tmp_path / "v2", ["0::/user.slice/app"], {
        "memory.current": str(9 * 2**30),  # the root: no memory.max
        "user.slice/memory.max": "max", "user.slice/memory.current": str(3 * 2**30),
        "user.slice/app/memory.max": str(4 * 2**30), "user.slice/app/memory.current": str(2**30),
    })
    assert _cgroup_left(proc, mount) == 3 * 2**30
    # a container that mounts its own cgroup at the top: the path is not there, the top's files are its own
    proc, mount = _cgroup_tree(tmp_path / "box", ["0::/kubepods/pod1"], {"memory.max": str(2**30), "memory.current": str(2**28)})
    assert _cgroup_left(proc, mount) == 2**30 - 2**28
    proc, mount = _cgroup_tree(tmp_path / "none", ["0::/"], {"memory.max": "max", "memory.current": "5"})
    assert _cgroup_left(proc, mount) is None


def test_the_cgroup_limit_is_read_once_and_its_usage_on_every_call(tmp_path):
    proc, mount = _cgroup_tree(tmp_path / "v1", ["4:memory:/job"], {
        "memory/memory.usage_in_bytes": "1", "memory/job/memory.limit_in_bytes": "1000000", "memory/job/memory.usage_in_bytes": "250000",
    })
    usage, limit = tmp_path / "v1/fs/memory/job/memory.usage_in_bytes", tmp_path / "v1/fs/memory/job/memory.limit_in_bytes"
    try:
        assert memory._cgroup_left(proc, mount) == 750_000
        usage.write_text("600000\n")
        assert memory._cgroup_left(proc, mount) == 400_000  # the usage moves with the cgroup
        limit.write_text("2000000\n")
        assert memory._cgroup_left(proc, mount) == 400_000  # the limit is the process's, read once
        memory._cgroup_limits.cache_clear()
        assert memory._cgroup_left(proc, mount) == 1_400_000
        limit.write_text("9223372036854771712\n")  # v1's way of writing no limit
        memory._cgroup_limits.cache_clear()
        assert memory._cgroup_left(proc, mount) is None
    finally:
        memory._cgroup_limits.cache_clear()
