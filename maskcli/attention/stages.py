"""Scaled dot-product attention in stages, so each stage can be shown:

    scores = Q Kᵀ  →  scaled = scores · scale  →  masked  →  weights = softmax  →  output = weights V

`fill` picks how the mask is applied: "-inf" (SDPA's way), "min" (finfo(dtype).min,
Hugging Face's eager way), "-1e9" (older tutorials), or "multiply" (softmax over all
keys, then zero the masked weights and renormalise each row: the other method tutorials
show). The fill value is written in the compute dtype, so -1e9 overflows float16 to -inf
exactly as it would in a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maskcli.attention import FILLS, STAGES  # noqa: F401  (re-exported with the stages)


@dataclass(frozen=True)
class Stages:
    """Every stage, each (B, H, Lq, Lk) except output (B, H, Lq, D); on the compute device."""

    scores: torch.Tensor
    scaled: torch.Tensor
    masked: torch.Tensor
    weights: torch.Tensor
    output: torch.Tensor
    keep: torch.Tensor  # bool (B, H, Lq, Lk), True = may attend
    scale: float
    fill: str
    dropout: float

    def stage(self, name: str) -> torch.Tensor:
        return getattr(self, name)


def fill_value(fill: str, dtype: torch.dtype) -> float:
    """The number written into masked scores, as the dtype stores it."""
    if fill == "-inf":
        return float("-inf")
    if fill == "min":
        return torch.finfo(dtype).min
    if fill == "-1e9":
        return torch.tensor(-1e9, dtype=dtype).item()
    raise ValueError(f"fill {fill!r} writes no value")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    scale: float | None = None,
    fill: str = "-inf",
    dropout: float = 0.0,
    seed: int = 0,
) -> Stages:
    """Run attention through `keep` (bool, broadcastable to (B, H, Lq, Lk)) and keep every stage."""
    if fill not in FILLS:
        raise ValueError(f"unknown fill {fill!r}; known: {', '.join(FILLS)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = keep.to(q.device)
    scores = q @ k.transpose(-2, -1)
    scaled = scores * scale
    if fill == "multiply":
        masked = scaled
        # multiply by the small mask: a product with a broadcast (stride 0) view is several times slower
        weights = torch.softmax(scaled, dim=-1) * compact(keep)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # 0 / 0 = NaN on a fully masked row
    else:
        # what masked_fill(~keep, value) gives, in one pass and without negating the mask
        masked = torch.where(keep, scaled, fill_value(fill, scaled.dtype))
        weights = torch.softmax(masked, dim=-1)
    if dropout > 0:
        # drawn on the CPU, as the random inputs are, so a seed drops the same weights on every
        # device (a CUDA generator draws other numbers from the same seed)
        generator = torch.Generator().manual_seed(seed)
        kept = (torch.rand(weights.shape, generator=generator) >= dropout).to(q.device)
        weights = weights * kept / (1 - dropout)
    output = weights @ v
    keep = keep if keep.shape == scores.shape else torch.broadcast_to(keep, scores.shape)
    return Stages(scores, scaled, masked, weights, output, keep, scale, fill, dropout)


def compact(tensor: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """The same values with each broadcast (stride 0) dimension, of `dims` or all, cut to size 1."""
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        if stride == 0 and size > 1 and (dims is None or dim in dims):
            tensor = tensor.narrow(dim, 0, 1)
    return tensor
