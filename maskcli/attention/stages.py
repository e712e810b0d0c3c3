"""Scaled dot-product attention in stages, so each stage can be shown:

    scores = Q Kᵀ  →  scaled  →  masked  →  weights = softmax  →  output = weights V

A pipeline (maskcli.attention.pipelines) says how: the tutorials' masked_fill(-inf), SDPA's math
backend, Hugging Face's eager attention, nn.MultiheadAttention with and without weights, or what
--fill builds: "-inf", "min" (finfo(dtype).min), "-1e9" (older tutorials) or "multiply" (softmax over
all keys, then zero the masked weights and renormalise each row). Fill values are written in the
compute dtype, so -1e9 overflows float16 to -inf exactly as it would in a model. Dropout is
nn.Dropout's: F.dropout after torch.manual_seed(seed), on the compute device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maskcli.attention import FILLS
from maskcli.attention.pipelines import Pipeline, pipeline


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
    pipeline: Pipeline
    dropout: float
    unmasked: torch.Tensor | None = None  # softmax of the scaled scores with no mask, when asked for

    @property
    def fill(self) -> str:
        return self.pipeline.fill

    def stage(self, name: str) -> torch.Tensor:
        found = getattr(self, name)
        if found is None:
            raise ValueError(f"stage {name!r} was not computed: pass unmasked=True")
        return found


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
    like: str | None = None,
    unmasked: bool = False,
) -> Stages:
    """Run attention through `keep` (bool, broadcastable to (B, H, Lq, Lk)) and keep every stage.

    `like` names a reference pipeline (LIKE); without it `fill` says how masked scores are hidden.
    `seed` seeds the dropout as torch.manual_seed does before nn.Dropout.
    """
    if fill not in FILLS:
        raise ValueError(f"unknown fill {fill!r}; known: {', '.join(FILLS)}")
    how = pipeline(like, fill)
    if like == "sdpa" and q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        # SDPA's math backend on the CPU computes half precision in float32 and casts the result back
        wide = attend(q.float(), k.float(), v.float(), keep, scale=scale, fill=fill, dropout=dropout, seed=seed, like=like, unmasked=unmasked)
        narrow = {name: getattr(wide, name).to(q.dtype) for name in ("scores", "scaled", "masked", "weights", "output")}
        return Stages(**narrow, keep=wide.keep, scale=wide.scale, pipeline=wide.pipeline, dropout=dropout,
                      unmasked=None if wide.unmasked is None else wide.unmasked.to(q.dtype))
    head_dim = q.shape[-1]
    given_scale = scale
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # each pipeline's own arithmetic, so that its numbers come out to the last bit
    scale_by = "multiply" if how.scale_by == "divide" and given_scale is not None else how.scale_by
    factor = {"divide": head_dim**0.5, "split": math.sqrt(scale), "query": math.sqrt(1.0 / float(head_dim)) if given_scale is None else scale}.get(scale_by, scale)
    keep = keep.to(q.device)
    scores = q @ k.transpose(-2, -1)
    scaled = _scaled(q, k, scores, scale_by, factor)
    if how.fill == "multiply":
        masked = scaled
        # multiply by the small mask: a product with a broadcast (stride 0) view is several times slower
        weights = torch.softmax(scaled, dim=-1) * compact(keep)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # 0 / 0 = NaN on a fully masked row
    else:
        value = fill_value(how.fill, scaled.dtype)
        if how.apply == "add":  # an additive mask: 0 where kept, the fill where masked, added to the scores
            masked = _added(q, k, keep, value, scaled, scale_by, factor)
        else:  # what masked_fill(~keep, value) gives, in one pass and without negating the mask
            masked = torch.where(keep, scaled, value)
        weights = _softmax(masked, how.softmax)
    if dropout > 0:
        torch.manual_seed(seed)  # as the tutorials do before nn.Dropout(p)
        weights = torch.nn.functional.dropout(weights, dropout, training=True)
    if how.output == "sdpa":
        bias = torch.where(keep, 0.0, float("-inf")).to(q.dtype)
        output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=given_scale)
    else:
        output = weights @ v
    plain = torch.softmax(scaled, dim=-1) if unmasked else None
    keep = keep if keep.shape == scores.shape else torch.broadcast_to(keep, scores.shape)
    return Stages(scores, scaled, masked, weights, output, keep, scale, how, dropout, plain)


def _scaled(q, k, scores, scale_by: str, factor: float) -> torch.Tensor:
    """The scaled scores, rounded as the pipeline's own code rounds them."""
    if scale_by == "divide":  # attn_scores / keys.shape[-1] ** 0.5
        return scores / factor
    if scale_by == "split":  # SDPA's math backend scales Q and K by √scale each, before the product
        return (q * factor) @ (k.transpose(-2, -1) * factor)
    if scale_by == "query":  # nn.MultiheadAttention: q_scaled = q * math.sqrt(1.0 / E)
        return (q * factor) @ k.transpose(-2, -1)
    return scores * factor


def _added(q, k, keep, value: float, scaled, scale_by: str, factor: float) -> torch.Tensor:
    """scaled + an additive mask (0 kept, `value` masked); for nn.MultiheadAttention in its own baddbmm."""
    # built in the scores' dtype, as Hugging Face's eager_mask builds it: finfo(float64).min does not fit a float32 bias
    bias = torch.where(keep, torch.zeros((), dtype=scaled.dtype, device=scaled.device), value)
    if scale_by == "query":
        batch, heads, q_len, k_len = scaled.shape
        q_scaled = (q * factor).reshape(batch * heads, q_len, -1)
        mask = torch.broadcast_to(bias, scaled.shape).reshape(batch * heads, q_len, k_len)
        return torch.baddbmm(mask, q_scaled, k.reshape(batch * heads, k_len, -1).transpose(-2, -1)).view(scaled.shape)
    return scaled + bias


def _softmax(masked: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "safe":  # what SDPA's math backend calls: a row with no finite score gives 0, not NaN
        return torch._safe_softmax(masked, -1)
    if kind == "float32":  # softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.softmax(masked, dim=-1, dtype=torch.float32).to(masked.dtype)
    return torch.softmax(masked, dim=-1)


def compact(tensor: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """The same values with each broadcast (stride 0) dimension, of `dims` or all, cut to size 1."""
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        if stride == 0 and size > 1 and (dims is None or dim in dims):
            tensor = tensor.narrow(dim, 0, 1)
    return tensor
