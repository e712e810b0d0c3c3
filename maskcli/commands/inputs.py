"""What attend and verify share: the input options, and building the mask and Q/K/V together."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from maskcli.commands.app import warn
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions


@dataclass(frozen=True)
class InputOptions:
    """The input and compute options of attend and verify, as given."""

    q: str | None
    k: str | None
    v: str | None
    x: str | None
    seed: int
    batch: int | None
    head_dim: int | None
    d_out: int | None
    qkv_bias: bool
    device: str
    dtype: str
    scale: float | None
    default_head_dim: int


def check_input_options(o: InputOptions) -> None:
    """Refuse a seed torch cannot take, a bad scale, and input options that the inputs in use would silently ignore."""
    import math

    import re

    from maskcli.conventions import DTYPES

    if not 0 <= o.seed < 2**63:
        raise MaskError(f"--seed must be 0 to {2**63 - 1} (a 64-bit seed), got {o.seed}")
    # names checked before torch is imported (whether a device is there is torch's to say)
    if o.dtype not in DTYPES:
        raise MaskError(f"unknown --dtype {o.dtype!r}: choose one of {', '.join(DTYPES)}")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?|mps", o.device):
        raise MaskError(f"unknown --device {o.device!r}: use auto, cpu, cuda, cuda:N or mps")
    given = {"--q": o.q, "--k": o.k, "--v": o.v}
    missing = [flag for flag, value in given.items() if value is None]
    if 0 < len(missing) < 3:
        raise MaskError(f"give all of --q, --k and --v (missing {', '.join(missing)}), or use --x or random inputs")
    if o.scale is not None and not 0 < o.scale < math.inf:
        raise MaskError(f"--scale must be a positive finite number, got {o.scale}")
    given_qkv = any(t is not None for t in (o.q, o.k, o.v))
    source = "--q/--k/--v" if given_qkv else "--x" if o.x is not None else None
    if source and o.batch is not None:
        raise MaskError(f"--batch {o.batch} is for random inputs, and {source} set the batch size: drop --batch")
    if source and o.head_dim is not None:
        how = "--q/--k/--v set it" if given_qkv else "with --x it is --d-out / --heads"
        raise MaskError(f"--head-dim {o.head_dim} is for random inputs, and {how}: drop --head-dim")
    if (o.d_out is not None or o.qkv_bias) and (given_qkv or o.x is None):
        flag = f"--d-out {o.d_out}" if o.d_out is not None else "--qkv-bias"
        raise MaskError(f"{flag} is for the projections of --x embeddings, and there is no --x in use: drop {flag.split()[0]}")
    if given_qkv and o.x is not None:
        warn("--x is ignored: --q/--k/--v take precedence")


def mask_and_inputs(expression: str | None, options: MaskOptions, o: InputOptions, dropout: float = 0.0):
    """The Mask and Q/K/V for attend and verify: given inputs decide the length unless --len or the data does."""
    from maskcli.sources import registry

    check_input_options(o)
    head_dim = o.default_head_dim if o.head_dim is None else o.head_dim
    checked_early = all(t is None for t in (o.q, o.k, o.v, o.x)) and options.mask_file is None and options.mask_mod is None
    if checked_early:  # refuse bad mask options and impossible sizes before importing torch
        _check_fits_before_torch(o, registry.load(expression, options), head_dim, dropout)

    from maskcli.attention.inputs import check_fits, load_given, make_qkv, resolve_device, resolve_dtype

    torch_device = resolve_device(o.device)
    torch_dtype = resolve_dtype(o.dtype)
    given = load_given(o.q, o.k, o.v, o.x)
    default = given.query_length(options.offset or 0) if given is not None else None
    if default is not None and default < 1:
        raise MaskError(f"--x has {given.x.shape[-2]} rows, which leave no query after --offset {options.offset}: give more rows or a smaller --offset")
    mask = registry.load(expression, options, default_length=default)
    for message in mask.warnings:
        warn(message)
    if mask.batch > 1 and o.batch is not None and o.batch != mask.batch:
        raise MaskError(f"--batch {o.batch} does not match the {mask.batch} batch rows of the mask (--lengths/--ids or labels): drop --batch")
    if given is None and not checked_early:
        _check_fits_before_torch(o, mask, head_dim, dropout)
    elif given is not None and given.x is not None:
        _check_projections_fit(given.x, o)
    qkv = make_qkv(
        given, seed=o.seed, batch=_batch(mask, o), heads=options.heads, head_dim=head_dim, d_out=o.d_out, qkv_bias=o.qkv_bias,
        q_len=mask.frame.q_len, k_len=mask.frame.k_len,
    )
    if given is not None:
        source = "--x (projected)" if given.x is not None else None
        for flag, tensor in (("--q", qkv.q), ("--k", qkv.k), ("--v", qkv.v)):
            check_fits(tensor, torch_dtype, source or flag)
    return mask, qkv, torch_device, torch_dtype


MAX_HEAD_DIM = 1 << 16  # random Q, K, V of a larger head size are gigabytes a token and say nothing more


def _batch(mask, o: InputOptions) -> int:
    """Batch rows of random inputs: the mask's own (padding, labels), else --batch, else 1."""
    return mask.batch if mask.batch > 1 else 1 if o.batch is None else o.batch


def _check_fits_before_torch(o: InputOptions, mask, head_dim: int, dropout: float) -> None:
    """Refuse random inputs (and, on the cpu, stages) that cannot be allocated: O(1), before torch is imported."""
    from maskcli.conventions import FLOAT_BYTES
    from maskcli.memory import ATTENTION_FIX, attention_bytes, attention_what, check_bytes_fit

    batch = _batch(mask, o)
    if head_dim < 1 or batch < 1:
        raise MaskError(f"--head-dim and --batch must be at least 1, got {head_dim} and {batch}")
    if head_dim > MAX_HEAD_DIM:
        raise MaskError(f"--head-dim {head_dim:,} is past the {MAX_HEAD_DIM:,} maskcli draws (models use 64 to 256): give a smaller one")
    cells = (batch, mask.heads, mask.frame.q_len, mask.frame.k_len)
    needed = 4 * batch * mask.heads * (mask.frame.q_len + 2 * mask.frame.k_len) * head_dim  # random Q, K, V: float32, on the host
    how = "for the random inputs"
    if _computes_on_cpu(o.device) and o.dtype in FLOAT_BYTES:
        needed += attention_bytes(cells, head_dim, FLOAT_BYTES[o.dtype], dropout)
        how = "for the random inputs and attention stages"
    check_bytes_fit(needed, attention_what(cells, head_dim), how, fix=ATTENTION_FIX)


def _computes_on_cpu(device: str) -> bool:
    """--device cpu, or auto on a machine with no GPU driver (no CUDA or ROCm device files, not a Mac): known
    without importing torch, so the stages' memory is checked up front there too."""
    import os

    if device == "cpu":
        return True
    gpu_files = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd", "/dev/dxg")
    return device == "auto" and sys.platform.startswith("linux") and not any(os.path.exists(path) for path in gpu_files)


def _check_projections_fit(x, o: InputOptions) -> None:
    """Refuse --x projections (three nn.Linear(d_in, d_out) and their outputs, float32) that cannot be allocated."""
    from maskcli.memory import check_bytes_fit

    d_in, rows = x.shape[-1], x.shape[-2]
    d_out = d_in if o.d_out is None else max(o.d_out, 1)
    batch = x.shape[0] if x.dim() == 3 else 1
    needed = 3 * 4 * (d_in * d_out + batch * rows * d_out)
    check_bytes_fit(needed, f"three projections of --x to --d-out {d_out} ({batch} x {rows} x {d_in} embeddings)", "in float32", fix="use a smaller --d-out")
