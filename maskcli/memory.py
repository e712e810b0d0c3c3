"""How much memory is free, and refusing a dense result that would not fit before building it."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

from maskcli.errors import MaskError

ATTENTION_FIX = "use a smaller --len, fewer --heads or --batch, a smaller --head-dim, or a smaller --dtype"
DENSITY_FIX = "use a smaller --len, or show it without --json/--save/--png to get a density map"


def available_memory(device=None) -> int | None:
    """Bytes this process can still take now on a CUDA `device`, else on the host; None where it cannot be told.

    On the host that is the least of free physical memory, what the address-space limit
    (RLIMIT_AS, `ulimit -v`) leaves beside what the process already maps, and what its
    cgroup's memory limit leaves.
    """
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        free = torch.cuda.mem_get_info(device)[0]
        # memory torch's caching allocator holds but no tensor uses is free to this process too
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    limits = [limit for limit in (_physical_free(), _address_space_left(), _cgroup_left()) if limit is not None]
    return max(0, min(limits)) if limits else None


def _physical_free() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_left() -> int | None:
    """RLIMIT_AS less the virtual memory this process maps already; None when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return soft - (_status_kib("VmSize") or 0) * 1024


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left(proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> int | None:
    """The least that this process's cgroup and each cgroup above it leave under their memory limits (v2, else
    v1); None when none is limited. The usage is read afresh on every call; the limits once (_cgroup_limits)."""
    rooms = []
    for limit, usage_file in _cgroup_limits(proc_cgroup, mount):
        try:
            rooms.append(limit - _read_int(usage_file))
        except (OSError, ValueError):
            continue
    return min(rooms) if rooms else None


@functools.lru_cache(maxsize=4)
def _cgroup_limits(proc_cgroup: str, mount: str) -> tuple[tuple[int, str], ...]:
    """(limit, usage file) of this process's cgroup and of each above it that sets a memory limit (v2, else v1).

    The process's own cgroup is read from /proc/self/cgroup: the files at the mount's top are the
    root cgroup's, which outside a container holds no limit of this process. Read once per process:
    a limit is set when the container starts, and opening the cgroup files on every guarded call
    cost more than the attention of a small mask (benchmarks/attend.py at L=64).
    """
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")), None) if lines else None
    for base, path, limit_name, usage_name in (
        (mount, v2, "memory.max", "memory.current"),
        (os.path.join(mount, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        folders = _cgroup_folders(base, path)
        if not any(os.path.exists(os.path.join(folder, usage_name)) for folder in folders):
            continue  # this version is not mounted here
        limits = []
        for folder in folders:
            try:
                with open(os.path.join(folder, limit_name)) as handle:
                    limit = handle.read().strip()
                usage_file = os.path.join(folder, usage_name)
                _read_int(usage_file)
            except (OSError, ValueError):
                continue
            if limit != "max" and limit.isascii() and limit.isdigit() and int(limit) < 2**60:  # v1 writes a huge number for no limit
                limits.append((int(limit), usage_file))
        return tuple(limits)
    return ()


def _cgroup_folders(base: str, path: str | None) -> list[str]:
    """The folder of cgroup `path` under `base` and those of its ancestors, deepest first (the top alone when
    the path is unknown, or not mounted here, as in a container that mounts its own cgroup at the top)."""
    parts = [part for part in (path or "").split("/") if part]
    folders = [os.path.join(base, *parts[:depth]) for depth in range(len(parts), 0, -1)]
    return [folder for folder in folders if os.path.isdir(folder)] + [base]


def _read_int(path: str) -> int:
    with open(path) as handle:
        return int(handle.read().strip())


def format_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def check_dense_fits(shape: tuple[int, ...], bytes_per_cell: float, how: str, device=None, fix: str = DENSITY_FIX, what: str = "the dense mask") -> None:
    """Refuse a dense result of `shape` that would not fit in the free memory of `device` (the host's by default)."""
    check_bytes_fit(math.prod(shape) * bytes_per_cell, f"{what} {' x '.join(map(str, shape))}", how, device, fix)


def check_bytes_fit(needed: float, what: str | Callable[[], str], how: str, device=None, fix: str = DENSITY_FIX) -> None:
    """Refuse `needed` bytes that would not fit in what `device` (the host by default) has left for this process.

    `what` may be a function, called only to word a refusal (attend checks on every call).
    """
    free = available_memory(device)
    if free is not None and needed > free:
        what = what() if callable(what) else what
        where = f" on {device}" if device is not None and getattr(device, "type", "cpu") != "cpu" else ""
        raise MaskError(
            f"{what} would need {format_bytes(needed)} ({needed:,.0f} bytes) {how}, "
            f"but only {format_bytes(free)} is free{where}: {fix}"
        )


def attention_bytes(cells: tuple[int, int, int, int], head_dim: int, float_bytes: int, dropout: float = 0.0) -> int:
    """Bytes the attention stages of (B, H, Lq, Lk) `cells` take, with Q, K, V and the output, at `float_bytes` a value."""
    batch, heads, q_len, k_len = cells
    # scores, scaled, masked, weights (and their temporaries) are each B x H x Lq x Lk, plus the
    # bool mask; dropout adds its random draw, its bool mask and one more product
    floats = 6 + (3 if dropout > 0 else 0)
    return math.prod(cells) * (floats * float_bytes + 1) + batch * heads * (2 * q_len + 2 * k_len) * head_dim * float_bytes


def attention_what(cells: tuple[int, int, int, int], head_dim: int) -> str:
    return f"{' x '.join(map(str, cells))} attention cells (head dim {head_dim})"
