"""The attend pipeline without any rendering: inputs and mask on a device, stages, findings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maskcli.attention.findings import Finding, run_findings
from maskcli.attention.inputs import QKV, check_against_mask
from maskcli.attention.stages import Stages, attend
from maskcli.errors import MaskError
from maskcli.mask import Mask
from maskcli.memory import ATTENTION_FIX, attention_bytes, attention_what, check_bytes_fit


@dataclass(frozen=True)
class Run:
    mask: Mask
    stages: Stages
    findings: list[Finding]
    device: torch.device
    source: str


def check_attention_fits(
    cells: tuple[int, int, int, int], head_dim: int, dtype: torch.dtype, device: torch.device, *, dropout: float = 0.0,
) -> None:
    """Refuse a run whose stages would not fit on `device`, before any of them is allocated."""
    check_bytes_fit(
        attention_bytes(cells, head_dim, dtype.itemsize, dropout), lambda: attention_what(cells, head_dim),
        "for the attention stages", device, fix=ATTENTION_FIX,
    )


def run_attention(
    mask: Mask,
    qkv: QKV,
    device: torch.device,
    dtype: torch.dtype,
    *,
    scale: float | None = None,
    fill: str = "-inf",
    dropout: float = 0.0,
    seed: int = 0,
    like: str | None = None,
    unmasked: bool = False,
) -> Run:
    """Build the mask on `device`, run every stage there in `dtype`, and collect findings."""
    qkv = check_against_mask(qkv, mask.shape)
    batch, heads = qkv.q.shape[:2]
    cells = (batch, heads, mask.frame.q_len, mask.frame.k_len)
    check_attention_fits(cells, qkv.q.shape[-1], dtype, device, dropout=dropout)
    q, k, v = qkv.q.to(device, dtype), qkv.k.to(device, dtype), qkv.v.to(device, dtype)
    keep = mask.materialize(device)
    try:
        stages = attend(q, k, v, keep, scale=scale, fill=fill, dropout=dropout, seed=seed, like=like, unmasked=unmasked)
    except torch.OutOfMemoryError:  # the guard above reads free memory, which others may take meanwhile
        raise MaskError(
            f"{device} ran out of memory for the attention stages ({' x '.join(map(str, cells))} cells each): "
            "use a smaller --len, fewer --heads or --batch, or another --device"
        ) from None
    findings = run_findings(stages, mask)
    return Run(mask, stages, findings, device, qkv.source)
