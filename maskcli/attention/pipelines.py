"""The reference pipelines attend reproduces by name (--like), and the one --fill builds.

A pipeline says how the scores are scaled, how the mask is applied, which softmax runs and
where the output comes from. Nothing here imports torch, so help text can list them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pipeline:
    name: str
    who: str  # the code that behaves this way, for help and headers
    fill: str  # what masked scores become: -inf, min (finfo(dtype).min), -1e9, or multiply (mask after the softmax)
    apply: str = "fill"  # fill: masked_fill(~keep, value); add: scores + additive mask (0 kept, value masked)
    scale_by: str = "multiply"  # multiply: (Q Kᵀ) × s; divide: (Q Kᵀ) / √D; split: (Q √s)(K √s)ᵀ; query: (Q s) Kᵀ
    softmax: str = "plain"  # plain; safe: 0 on rows that see no key; float32: in float32, then cast back
    output: str = "matmul"  # matmul: weights V; sdpa: F.scaled_dot_product_attention itself


LIKE = {
    "tutorial": Pipeline(
        "tutorial", "the classic tutorials: masked_fill(mask == 0, -inf), softmax(masked / √D); NaN on rows that see no key",
        "-inf", "fill", "divide",
    ),
    "sdpa": Pipeline(
        "sdpa", "F.scaled_dot_product_attention's math backend: an additive -inf mask, (Q √s)(K √s)ᵀ, a safe softmax that "
        "gives 0 on rows that see no key", "-inf", "add", "split", "safe",
    ),
    "hf-eager": Pipeline(
        "hf-eager", "Hugging Face eager attention: (Q Kᵀ) × s + a finfo(dtype).min mask, softmax in float32 cast back; "
        "rows that see no key get uniform weights, or NaN in float64 (its min is -inf in float32)", "min", "add", "multiply", "float32",
    ),
    "mha": Pipeline(
        "mha", "nn.MultiheadAttention with need_weights=False: it calls SDPA with a -inf mask (the output is SDPA's own; "
        "the weights shown are its math backend's)", "-inf", "add", "split", "safe", "sdpa",
    ),
    "mha-weights": Pipeline(
        "mha-weights", "nn.MultiheadAttention with need_weights=True: baddbmm(-inf mask, Q/√D, Kᵀ), softmax (NaN on rows "
        "that see no key); per-head weights, as average_attn_weights=False returns them", "-inf", "add", "query",
    ),
}

FILL_WHO = {
    "-inf": "masked_fill -inf",
    "min": "masked_fill finfo.min",
    "-1e9": "masked_fill -1e9",
    "multiply": "softmax, then multiply by the mask and renormalise",
}


FILLED = {fill: Pipeline(fill, who, fill) for fill, who in FILL_WHO.items()}  # made once: attend asks on every call


def pipeline(like: str | None, fill: str = "-inf") -> Pipeline:
    """The --like pipeline, or the one --fill builds (scores × scale, masked_fill or multiply, softmax)."""
    if like is not None:
        return LIKE[like]
    return FILLED[fill]
