# NVIDIA/TransformerEngine#1069 (commit a326e351, "[PyTorch] Fix issues with cross attention").
#
# transformer_engine/pytorch/transformer.py, TransformerLayer.forward with layer_type="decoder": the
# self-attention was called with window_size=enc_dec_window_size (the cross-attention's window) instead of
# window_size, and the inter (cross) attention was called without attn_mask_type=enc_dec_attn_mask_type /
# window_size=enc_dec_window_size, so a mask type given to forward() never reached it (the module kept the
# type it was built with, "no_mask" by default). The fix passes window_size to the self-attention and both
# enc_dec arguments to the inter-attention.
#
# Ported in plain torch on CPU: TransformerLayer -> MultiheadAttention -> DotProductAttention (its unfused
# path: get_swa_mask, UnfusedDotProductAttention, FusedScaleMaskSoftmax.forward_torch_softmax), sbhd layout.
# The decoder layer is built with a causal sliding window (window_size=(2, 0)); forward() gets the encoder
# output of a right-padded source batch with an "arbitrary" encoder-decoder mask.
import sys
import warnings
from typing import Optional, Tuple

import torch

FIXED = "--fixed" in sys.argv

AttnMaskTypes = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)

_default_causal_mask = {}


def check_set_window_size(attn_mask_type: str, window_size: Tuple[int, int] = None):
    orig_window_size = window_size
    if "causal" in attn_mask_type:
        if orig_window_size is None:
            window_size = (-1, 0)
        elif orig_window_size == (-1, -1) or (orig_window_size[0] >= 0 and orig_window_size[1] != 0):
            window_size = (orig_window_size[0], 0)
            warnings.warn("window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type)
        elif orig_window_size != (-1, 0) and (orig_window_size[0] < 0 or orig_window_size[1] != 0):
            assert False, "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type
    elif attn_mask_type in ["no_mask", "padding", "arbitrary"]:
        if orig_window_size is None:
            window_size = (-1, -1)
        elif orig_window_size == (-1, 0):
            window_size = (-1, -1)
            warnings.warn("window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type)
        elif orig_window_size != (-1, -1) and (orig_window_size[0] < 0 or orig_window_size[1] < 0):
            assert False, "window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type
    else:
        assert False, "Invalid attn_mask_type: " + attn_mask_type
    return window_size


@torch.no_grad()
def get_swa_mask(window_size, max_seqlen_q, max_seqlen_kv, attn_mask_type="no_mask", attention_mask=None):
    mask = torch.ones(max_seqlen_q, max_seqlen_kv, dtype=torch.bool)
    if attn_mask_type in ["causal"]:
        left = window_size[0] if window_size[0] != -1 else max_seqlen_q
        right = window_size[1] if window_size[1] != -1 else max_seqlen_q
        mask_upper = torch.triu(mask, diagonal=-left)
        mask_lower = torch.tril(mask_upper, diagonal=right)
    else:
        left = window_size[0] if window_size[0] != -1 else max_seqlen_kv
        right = window_size[1] if window_size[1] != -1 else max_seqlen_kv
        mask_upper = torch.triu(mask, diagonal=max_seqlen_kv - max_seqlen_q - left)
        mask_lower = torch.tril(mask_upper, diagonal=max_seqlen_kv - max_seqlen_q + right)
    attn_mask_type = "arbitrary"
    mask = mask_lower.logical_not()
    if attention_mask is not None:
        mask = torch.logical_and(attention_mask, mask)
    return attn_mask_type, mask


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def _get_default_causal_mask(mask_type: str, sq: int, sk: int) -> torch.Tensor:
    if sq == 1:
        return torch.zeros((1, sk), dtype=torch.bool)
    matrix_identifiers = (mask_type, sq, sk)
    if matrix_identifiers not in _default_causal_mask:
        diagonal_offset = sk - sq + 1 if "bottom_right" in mask_type else 1
        _default_causal_mask[matrix_identifiers] = torch.triu(
            torch.ones(sq, sk, dtype=torch.bool), diagonal=diagonal_offset
        )
    return _default_causal_mask[matrix_identifiers]


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Framework (torch) softmax path only: the CUDA kernels are not available on CPU."""

    def __init__(self, mask_func):
        super().__init__()
        self.mask_func = mask_func

    def forward(self, inp, mask, attn_mask_type, scale=None):
        self.attn_mask_type = attn_mask_type
        return self.forward_torch_softmax(inp, mask, scale)

    def forward_torch_softmax(self, inp, mask, scale=None):
        if scale is not None:
            inp = inp * scale
        if "causal" in self.attn_mask_type:
            seq_len_q, seq_len_k = inp.size(2), inp.size(3)
            mask = _get_default_causal_mask(self.attn_mask_type, seq_len_q, seq_len_k)
        mask_output = inp
        if mask is not None and self.attn_mask_type != "no_mask":
            mask_output = self.mask_func(inp, mask)
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


class UnfusedDotProductAttention(torch.nn.Module):
    def __init__(self, softmax_scale: float):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attention_mask_func)

    def forward(self, query_layer, key_layer, value_layer, attn_mask_type="causal", attention_mask=None):
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.empty(
            output_size[0] * output_size[1], output_size[2], output_size[3], dtype=query_layer.dtype
        )
        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),
            key_layer.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=self.softmax_scale,
        )
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask, attn_mask_type, None)

        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        # [b, np, sq, hn] --> [sq, b, np, hn] --> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        return context_layer.view(output_size[2], output_size[0], -1)


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads, kv_channels, attn_mask_type="causal", window_size=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.window_size = check_set_window_size(attn_mask_type, window_size)
        self.unfused_attention = UnfusedDotProductAttention(softmax_scale=kv_channels ** -0.5)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None,
                window_size=None):
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        if window_size is None:
            window_size = self.window_size
        window_size = check_set_window_size(attn_mask_type, window_size)
        max_seqlen_q, max_seqlen_kv = query_layer.shape[0], key_layer.shape[0]
        if window_size is not None and (window_size[0] != -1 or window_size[1] not in [-1, 0]):
            attn_mask_type, attention_mask = get_swa_mask(
                window_size, max_seqlen_q, max_seqlen_kv, attn_mask_type, attention_mask
            )
        return self.unfused_attention(
            query_layer, key_layer, value_layer, attn_mask_type=attn_mask_type, attention_mask=attention_mask
        )


class MultiheadAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, attn_mask_type="causal", window_size=None,
                 attention_type="self"):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.window_size = check_set_window_size(attn_mask_type, window_size)
        self.attention_type = attention_type
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.layernorm = torch.nn.LayerNorm(hidden_size)
        if attention_type == "self":
            self.qkv = torch.nn.Linear(hidden_size, 3 * hidden_size)
        else:
            self.query_layer = torch.nn.Linear(hidden_size, hidden_size)
            self.key_value = torch.nn.Linear(hidden_size, 2 * hidden_size)
        self.core_attention = DotProductAttention(
            num_attention_heads, self.hidden_size_per_attention_head, attn_mask_type, window_size
        )
        self.proj = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
                window_size=None):
        # hidden_states: [sq, b, h]
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        if window_size is None:
            window_size = self.window_size
        window_size = check_set_window_size(attn_mask_type, window_size)

        ln_out = self.layernorm(hidden_states)
        np_, hn = self.num_attention_heads, self.hidden_size_per_attention_head
        if self.attention_type == "self":
            mixed = self.qkv(ln_out)
            mixed = mixed.view(mixed.shape[0], mixed.shape[1], np_, 3 * hn)
            query_layer, key_layer, value_layer = torch.split(mixed, hn, dim=3)
        else:
            mixed_kv = self.key_value(encoder_output)
            mixed_kv = mixed_kv.view(mixed_kv.shape[0], mixed_kv.shape[1], np_, 2 * hn)
            key_layer, value_layer = torch.split(mixed_kv, hn, dim=3)
            query_layer = self.query_layer(ln_out)
            query_layer = query_layer.view(query_layer.shape[0], query_layer.shape[1], np_, hn)

        context_layer = self.core_attention(
            query_layer,
            key_layer,
            value_layer,
            attention_mask=attention_mask,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
        )
        return self.proj(context_layer)


class TransformerLayer(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, self_attn_mask_type="causal",
                 window_size=None, enc_dec_attn_mask_type="no_mask", enc_dec_window_size=None,
                 layer_type="encoder"):
        super().__init__()
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = check_set_window_size(self_attn_mask_type, window_size)
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = check_set_window_size(enc_dec_attn_mask_type, enc_dec_window_size)
        self.layer_type = layer_type
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type, window_size=window_size,
            attention_type="self",
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size, attention_type="cross",
            )
        self.layernorm_mlp = torch.nn.Sequential(
            torch.nn.LayerNorm(hidden_size),
            torch.nn.Linear(hidden_size, ffn_hidden_size),
            torch.nn.GELU(approximate="tanh"),
            torch.nn.Linear(ffn_hidden_size, hidden_size),
        )

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None,
                encoder_output=None, enc_dec_attn_mask=None, enc_dec_attn_mask_type=None,
                enc_dec_window_size=None):
        if self_attn_mask_type is None:
            self_attn_mask_type = self.self_attn_mask_type
        if window_size is None:
            window_size = self.window_size
        window_size = check_set_window_size(self_attn_mask_type, window_size)
        if enc_dec_attn_mask_type is None:
            enc_dec_attn_mask_type = self.enc_dec_attn_mask_type
        if enc_dec_window_size is None:
            enc_dec_window_size = self.enc_dec_window_size
        enc_dec_window_size = check_set_window_size(enc_dec_attn_mask_type, enc_dec_window_size)

        assert self_attn_mask_type in AttnMaskTypes
        assert enc_dec_attn_mask_type in AttnMaskTypes

        hidden_states = hidden_states.contiguous()

        # Self attention.
        if FIXED:
            attention_output = self.self_attention(
                hidden_states,
                attention_mask=attention_mask,
                attn_mask_type=self_attn_mask_type,
                window_size=window_size,
            )
        else:
            attention_output = self.self_attention(
                hidden_states,
                attention_mask=attention_mask,
                attn_mask_type=self_attn_mask_type,
                window_size=enc_dec_window_size,
            )
        hidden_states = attention_output + hidden_states

        # Cross attention.
        if self.layer_type == "decoder":
            if FIXED:
                attention_output = self.inter_attention(
                    hidden_states,
                    attention_mask=enc_dec_attn_mask,
                    attn_mask_type=enc_dec_attn_mask_type,
                    window_size=enc_dec_window_size,
                    encoder_output=encoder_output,
                )
            else:
                attention_output = self.inter_attention(
                    hidden_states,
                    attention_mask=enc_dec_attn_mask,
                    encoder_output=encoder_output,
                )
            hidden_states = attention_output + hidden_states

        # MLP.
        output = self.layernorm_mlp(hidden_states) + hidden_states
        return output


def main():
    torch.manual_seed(0)
    hidden_size, ffn_hidden_size, num_heads = 32, 64, 4
    batch, tgt_len, src_len = 2, 6, 7
    src_lens = torch.tensor([7, 4])

    layer = TransformerLayer(
        hidden_size,
        ffn_hidden_size,
        num_heads,
        self_attn_mask_type="causal",
        window_size=(2, 0),
        layer_type="decoder",
    ).eval()

    # sbhd: [s, b, h]
    decoder_input = torch.randn(tgt_len, batch, hidden_size)
    encoder_output = torch.randn(src_len, batch, hidden_size)

    # True = masked out; [b, 1, sq, skv] for the "arbitrary" encoder-decoder mask.
    src_pad = torch.arange(src_len)[None, :] >= src_lens[:, None]
    enc_dec_attn_mask = src_pad[:, None, None, :].expand(batch, 1, tgt_len, src_len)

    with torch.no_grad():
        out = layer(
            decoder_input,
            encoder_output=encoder_output,
            enc_dec_attn_mask=enc_dec_attn_mask,
            enc_dec_attn_mask_type="arbitrary",
        )

    print("output", tuple(out.shape))
    print("last decoder position, row 1:", [round(v, 4) for v in out[-1, 1, :6].tolist()])
    print("mean |out|:", round(out.abs().mean().item(), 6))


if __name__ == "__main__":
    main()
