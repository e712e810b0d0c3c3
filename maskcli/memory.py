"""How much memory is free, and refusing a dense result that would not fit before building it."""

from __future__ import annotations

import math
import os

from maskcli.errors import MaskError

DENSITY_FIX = "use a smaller --len, or show it without --json/--save/--png to get a density map"


def available_memory(device=None) -> int | None:
    """Bytes free now on a CUDA `device`, else of physical memory; None where it cannot be told."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        free = torch.cuda.mem_get_info(device)[0]
        # memory torch's caching allocator holds but no tensor uses is free to this process too
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def check_dense_fits(shape: tuple[int, ...], bytes_per_cell: float, how: str, device=None, fix: str = DENSITY_FIX, what: str = "the dense mask") -> None:
    """Refuse a dense result of `shape` that would not fit in the free memory of `device` (the host's by default)."""
    needed = math.prod(shape) * bytes_per_cell
    free = available_memory(device)
    if free is not None and needed > free:
        dims = " x ".join(map(str, shape))
        where = f" on {device}" if device is not None and getattr(device, "type", "cpu") != "cpu" else ""
        raise MaskError(
            f"{what} {dims} would need {format_bytes(needed)} ({needed:,.0f} bytes) {how}, "
            f"but only {format_bytes(free)} is free{where}: {fix}"
        )
