"""Megatron-core style attention whose causal masking is chosen by an AttnMaskType enum, not a mask tensor.

Follows NVIDIA/Megatron-LM megatron/core/transformer/enums.py (AttnMaskType.padding / causal / no_mask),
megatron/core/fusions/fused_softmax.py (FusedScaleMaskSoftmax.forward_torch_softmax: for AttnMaskType.causal with
no mask given and sq > 1 it builds get_default_causal_mask(sq) itself, as the fused ScaledUpperTriangMaskedSoftmax
kernel does) and
megatron/core/transformer/dot_product_attention.py (DotProductAttention.forward with [sq, b, np, hn] layout,
baddbmm of q and k^T). GPT layer specs pass attn_mask_type=AttnMaskType.causal and, when training without
reset_attention_mask, attention_mask=None. fused_softmax.py read at the stored version; the rest recalled.

Mask meant: plain causal self-attention for a GPT decoder during training, selected by the enum.
"""
import enum
from dataclasses import dataclass

import torch
import torch.nn as nn

torch.manual_seed(0)


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3


@dataclass
class TransformerConfig:
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True


def get_default_causal_mask(sq: int) -> torch.Tensor:
    """True above the diagonal: the keys a query may NOT see (Megatron masks where True)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class FusedScaleMaskSoftmax(nn.Module):
    """Scale, mask and softmax; for a causal mask type the mask is built here when none is passed."""

    def __init__(self, attn_mask_type, mask_func, scale):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.mask_func = mask_func
        self.scale = scale

    def forward(self, input, mask):
        sq, sk = input.size(2), input.size(3)
        if self.scale is not None:
            input = input * self.scale
        if self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            assert sq == sk, "causal mask is only for self attention"
            mask = get_default_causal_mask(sq)
        mask_output = self.mask_func(input, mask) if mask is not None else input
        return torch.nn.Softmax(dim=-1)(mask_output)


class DotProductAttention(nn.Module):
    def __init__(self, config, layer_number, attn_mask_type):
        super().__init__()
        self.config = config
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.norm_factor = self.hidden_size_per_attention_head ** 0.5
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attn_mask_type, attention_mask_func, None)

    def forward(self, query, key, value, attention_mask):
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        query = query.reshape(sq, b * np_, hn)
        key = key.reshape(sk, b * np_, hn)
        matmul_input_buffer = torch.empty(b * np_, sq, sk, dtype=query.dtype)
        matmul_result = torch.baddbmm(matmul_input_buffer, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2),
                                      beta=0.0, alpha=1.0 / self.norm_factor)
        attention_scores = matmul_result.view(b, np_, sq, sk)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        value = value.reshape(sk, b * np_, hn)
        context = torch.bmm(attention_probs.view(b * np_, sq, sk), value.transpose(0, 1))
        return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number, attn_mask_type=AttnMaskType.padding):
        super().__init__()
        self.config = config
        self.linear_qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.core_attention = DotProductAttention(config, layer_number, attn_mask_type)
        self.linear_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask):
        sq, b, _ = hidden_states.shape
        np_ = self.config.num_attention_heads
        mixed = self.linear_qkv(hidden_states).view(sq, b, np_, 3 * (self.config.hidden_size // np_))
        q, k, v = torch.split(mixed, self.config.hidden_size // np_, dim=3)
        return self.linear_proj(self.core_attention(q, k, v, attention_mask))


config = TransformerConfig()
layers = nn.ModuleList([SelfAttention(config, i + 1, attn_mask_type=AttnMaskType.causal)
                        for i in range(config.num_layers)])
hidden = torch.randn(12, 2, config.hidden_size)   # [s, b, h]
with torch.no_grad():
    h = hidden
    for layer in layers:
        h = h + layer(h, attention_mask=None)
    # reference: the same layers through SDPA with is_causal=True
    r = hidden
    for layer in layers:
        mixed = layer.linear_qkv(r).view(12, 2, 4, 24)
        q, k, v = (t.permute(1, 2, 0, 3) for t in torch.split(mixed, 8, dim=3))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        r = r + layer.linear_proj(o.permute(2, 0, 1, 3).reshape(12, 2, 32))
    assert torch.allclose(h, r, atol=1e-5)
print("causal via AttnMaskType.causal ok")
