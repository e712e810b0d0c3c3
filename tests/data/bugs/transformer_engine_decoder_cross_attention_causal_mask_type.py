"""Transformer Engine TransformerLayer (decoder): cross-attention run with the self-attention mask type.

Citation: NVIDIA/TransformerEngine#565 ("[PyTorch] fix attn_mask_type for inter_attention", commit bd0873a).

Bug: ``TransformerLayer.__init__`` builds ``self.inter_attention`` (encoder-decoder attention) with
``attn_mask_type="padding"``, but ``forward`` calls it with ``attn_mask_type=self_attn_mask_type``,
typically ``"causal"``. The core attention then applies a causal mask to the decoder-to-encoder scores and
drops ``enc_dec_attn_mask``: target position i sees only encoder positions <= i, and padded encoder
positions inside that triangle are attended.
Fix: remove the ``attn_mask_type=self_attn_mask_type`` override so the inter-attention keeps ``"padding"``.

This program: TE's structure reduced to the unfused path (``MultiheadAttention`` -> ``DotProductAttention``
-> ``FusedScaleMaskSoftmax`` torch fallback, masked_fill -10000, True = masked) for a decoder layer with
``self_attn_mask_type="causal"``, target and source length 5 (sq == sk, so the causal default mask fits),
source lengths [5, 3] given as ``enc_dec_attn_mask`` [b, 1, 1, sk].
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def _get_default_causal_mask(sq: int) -> torch.Tensor:
    """Return the causal upper triangular mask for softmax input (True = masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def attention_mask_func(attention_scores, attention_mask):
    return attention_scores.masked_fill(attention_mask, -10000.0)


class FusedScaleMaskSoftmax(nn.Module):
    def __init__(self, attn_mask_type: str, mask_func):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.mask_func = mask_func

    def forward(self, inp, mask, attn_mask_type, scale=None):
        self.attn_mask_type = attn_mask_type
        return self.forward_torch_softmax(inp, mask, scale)

    def forward_torch_softmax(self, inp, mask, scale=None):
        if scale is not None:
            inp = inp * scale
        if self.attn_mask_type == "causal":
            mask = _get_default_causal_mask(inp.size(2))
        mask_output = self.mask_func(inp, mask) if mask is not None else inp
        return torch.nn.Softmax(dim=-1)(mask_output)


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, attn_mask_type="causal"):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.norm_factor = math.sqrt(kv_channels)
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attn_mask_type, attention_mask_func)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
        # [sq, b, np, hn]
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        q = query_layer.reshape(sq, b * np_, hn).transpose(0, 1)
        k = key_layer.reshape(sk, b * np_, hn).transpose(0, 1)
        v = value_layer.reshape(sk, b * np_, hn).transpose(0, 1)
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk), q, k.transpose(1, 2), beta=0.0, alpha=1.0 / self.norm_factor)
        scores = scores.view(b, np_, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, attn_mask_type)
        context = torch.bmm(probs.view(b * np_, sq, sk), v)
        return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, attention_type="self", attn_mask_type="causal"):
        super().__init__()
        self.attention_type, self.attn_mask_type = attention_type, attn_mask_type
        self.num_heads, self.head_dim = num_attention_heads, hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key_value = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.core_attention = DotProductAttention(num_attention_heads, self.head_dim, attn_mask_type)

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None):
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        kv_input = hidden_states if self.attention_type == "self" else encoder_output
        shape_q = hidden_states.shape[:2] + (self.num_heads, self.head_dim)
        shape_kv = kv_input.shape[:2] + (self.num_heads, self.head_dim)
        q = self.query(hidden_states).view(shape_q)
        k, v = self.key_value(kv_input).chunk(2, dim=-1)
        context = self.core_attention(
            q, k.reshape(shape_kv), v.reshape(shape_kv), attention_mask=attention_mask, attn_mask_type=attn_mask_type
        )
        return self.proj(context)


class TransformerLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_type="encoder", self_attn_mask_type="causal"):
        super().__init__()
        self.layer_type, self.self_attn_mask_type = layer_type, self_attn_mask_type
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, "self", self_attn_mask_type)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(hidden_size, num_attention_heads, "cross", attn_mask_type="padding")
        self.layernorm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, encoder_output=None,
                enc_dec_attn_mask=None):
        if self_attn_mask_type is None:
            self_attn_mask_type = self.self_attn_mask_type
        hidden_states = hidden_states + self.self_attention(
            self.layernorm(hidden_states), attention_mask=attention_mask, attn_mask_type=self_attn_mask_type
        )
        if self.layer_type == "decoder":
            if FIXED:
                inter_attention_outputs = self.inter_attention(
                    hidden_states, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output
                )
            else:
                inter_attention_outputs = self.inter_attention(
                    hidden_states,
                    attention_mask=enc_dec_attn_mask,
                    attn_mask_type=self_attn_mask_type,
                    encoder_output=encoder_output,
                )
            hidden_states = hidden_states + inter_attention_outputs
        return hidden_states


def main():
    torch.manual_seed(0)
    layer = TransformerLayer(32, 4, layer_type="decoder", self_attn_mask_type="causal").eval()
    sq, sk, src_lengths = 5, 5, torch.tensor([5, 3])
    hidden_states = torch.randn(sq, 2, 32)  # [s, b, h]
    encoder_output = torch.randn(sk, 2, 32)
    enc_dec_attn_mask = (torch.arange(sk)[None, :] >= src_lengths[:, None])[:, None, None, :]  # True = masked
    with torch.no_grad():
        out = layer(hidden_states, encoder_output=encoder_output, enc_dec_attn_mask=enc_dec_attn_mask)
    print("decoder out", tuple(out.shape), "norm %.4f" % out.norm())


if __name__ == "__main__":
    main()
