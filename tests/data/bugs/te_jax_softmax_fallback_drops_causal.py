"""Transformer Engine (JAX) unfused DotProductAttention: causal softmax fallback applies no mask.

Citation: NVIDIA/TransformerEngine#1524 "Causal mask ignored in DotProductAttention" (TE 1.14),
fixed by NVIDIA/TransformerEngine#1681 "Fix #1524 and other softmax mask functionality" (merged,
release 2.3.0: "Add fallback jax implementation for scaled_upper_triangle").

``transformer_engine.jax.flax.module.Softmax.__call__`` picks the fused softmax kernel for its
``softmax_type`` when ``is_softmax_kernel_available`` says so. For ``attn_mask_type='causal'`` the
unfused attention maps the mask type to ``SoftmaxType.SCALED_UPPER_TRIANG_MASKED`` and hands the
Softmax no mask tensor (TE documents the mask as ignored for 'causal'). When that kernel is not
available, the fallback ran ``softmax(logits, None, scale, SoftmaxType.SCALED)`` or plain
``jax.nn.softmax(logits * scale)``: ``self.softmax_type`` was ignored and no causal mask was
applied, so every query attended to later keys. The fix adds a fallback implementation of the
upper-triangle-masked softmax (the causal mask is applied before the softmax).

This program ports the module structure to torch: ``SoftmaxType``, ``is_softmax_kernel_available``
(the fused kernels are CUDA-only, so on CPU it is False, which is exactly the fallback path), the
``Softmax`` module, and ``_UnfusedDotProductAttention`` configured with ``attn_mask_type='causal'``.
Attention is an explicit softmax over ``q @ k^T``.
"""
import sys
from enum import Enum

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class SoftmaxType(Enum):
    SCALED = "scaled"
    SCALED_MASKED = "scaled_masked"
    SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang_masked"


class AttnMaskType(Enum):
    NO_MASK = "no_mask"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"


def canonicalize_attn_mask_type(attn_mask_type: str) -> AttnMaskType:
    return AttnMaskType(attn_mask_type)


def is_softmax_kernel_available(softmax_type, batch, heads, q_seqlen, k_seqlen, dtype) -> bool:
    # The fused softmax custom calls are CUDA kernels (TE also checks shapes and dtype); on a CPU
    # they are never available, so the fallback below is the path taken.
    return False


def make_causal_mask(q_seqlen, k_seqlen):
    # TE convention: mask > 0 marks a position that must NOT be attended.
    return (torch.arange(k_seqlen)[None, :] > torch.arange(q_seqlen)[:, None]).to(torch.uint8)


def jax_scaled_upper_triang_masked_softmax(logits, scale_factor):
    q_seqlen, k_seqlen = logits.shape[-2:]
    mask = make_causal_mask(q_seqlen, k_seqlen)
    return torch.softmax((logits * scale_factor).masked_fill(mask.bool(), -1e10), dim=-1)


class Softmax(nn.Module):
    def __init__(self, scale_factor: float = 1.0, softmax_type: SoftmaxType = SoftmaxType.SCALED):
        super().__init__()
        self.scale_factor = scale_factor
        self.softmax_type = softmax_type

    def forward(self, inputs, mask=None, bias=None):
        batch, heads, q_seqlen, k_seqlen = inputs.shape
        dtype = inputs.dtype
        logits = inputs

        if self.softmax_type is not SoftmaxType.SCALED and is_softmax_kernel_available(
            self.softmax_type, batch, heads, q_seqlen, k_seqlen, dtype
        ):
            raise RuntimeError("fused softmax kernels are not part of this CPU port")

        attention_bias = None
        if mask is not None:
            attention_bias = torch.where(mask > 0, torch.full(mask.shape, -1e10), torch.zeros(mask.shape))
            attention_bias = attention_bias.to(dtype)
        if bias is not None:
            attention_bias = bias if attention_bias is None else attention_bias + bias
        if attention_bias is not None:
            logits = logits + attention_bias.to(dtype)

        if FIXED and self.softmax_type is SoftmaxType.SCALED_UPPER_TRIANG_MASKED:
            # The fix: a fallback implementation of the upper-triangle-masked softmax.
            return jax_scaled_upper_triang_masked_softmax(logits, self.scale_factor)
        # For the case that self.softmax == SoftmaxType.SCALED_UPPER_TRIANG_MASKED
        # and kernel is unavailable, then try on pure scaled softmax custom calls.
        return torch.softmax(logits * self.scale_factor, dim=-1)


class _UnfusedDotProductAttention(nn.Module):
    def __init__(self, head_dim: int, attn_mask_type: str = "causal", scale_factor=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.scale_factor = scale_factor if scale_factor is not None else 1.0 / head_dim ** 0.5

    def forward(self, query, key, value, mask=None, bias=None):
        # query/key/value: [batch, seqlen, heads, head_dim] (TE JAX BSHD layout)
        attn_weights = torch.einsum("bqhd,bkhd->bhqk", query, key)

        attn_mask_type = canonicalize_attn_mask_type(self.attn_mask_type)
        if attn_mask_type in (AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK):
            softmax_type = SoftmaxType.SCALED_UPPER_TRIANG_MASKED
            mask = None  # 'causal': the mask argument is ignored, the softmax type carries it
        elif attn_mask_type is AttnMaskType.PADDING_MASK and mask is not None:
            softmax_type = SoftmaxType.SCALED_MASKED
        else:
            softmax_type = SoftmaxType.SCALED

        attn_weights = Softmax(scale_factor=self.scale_factor, softmax_type=softmax_type)(attn_weights, mask, bias)
        return torch.einsum("bhqk,bkhd->bqhd", attn_weights, value)


class DecoderSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, attn_mask_type="causal"):
        super().__init__()
        self.num_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.core_attention = _UnfusedDotProductAttention(self.head_dim, attn_mask_type=attn_mask_type)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.num_heads, self.head_dim).unbind(2)
        return self.out(self.core_attention(q, k, v).reshape(B, S, -1))


def main():
    torch.manual_seed(0)
    layer = DecoderSelfAttention(attn_mask_type="causal").eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        y = layer(x)
    print("first-token output[0, 0, :4]:", [round(v, 4) for v in y[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
