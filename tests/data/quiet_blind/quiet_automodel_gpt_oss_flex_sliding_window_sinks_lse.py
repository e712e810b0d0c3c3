# Correct program. Ported from NVIDIA-NeMo/Automodel @36044ad3d139363fb6c73c24af2e7c6b65ec52f6:
# nemo_automodel/components/attention/flex_attention.py (FlexAttention.forward: a BlockMask cached per
# (sliding_window, B, Hq, Sq, Skv, device) from _get_sliding_window_mask_mod / _get_causal_mask_mod, and
# attention sinks applied as out * sigmoid(lse - sink_weights[h])), nemo_automodel/components/attention/utils.py
# (initialize_attn_module_and_func "flex", preprocess_args_and_kwargs_for_attn transposes to B H S D) and
# nemo_automodel/components/models/gpt_oss/layers.py (GptOssAttention, flex backend: sliding_window on
# alternate layers, sinks parameter, enable_gqa=True). GPT-OSS pre-training style: fixed-length rows, no padding.
# On CPU flex_attention runs eagerly (the project wraps it in torch.compile); plain RoPE stands in for YaRN.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)


class FlexAttention(torch.nn.Module):
    flex_attn = flex_attention
    block_masks = {}

    def forward(self, q, k, v, scale=None, sink_weights=None, sliding_window=0, enable_gqa=False):
        batch_size, num_q_heads, q_len, _ = q.shape
        kv_len = k.shape[2]
        mask_key = (sliding_window, batch_size, num_q_heads, q_len, kv_len, q.device)
        if mask_key not in FlexAttention.block_masks:
            if sliding_window is not None and sliding_window > 0:
                mask_mod = FlexAttention._get_sliding_window_mask_mod(sliding_window)
            else:
                mask_mod = FlexAttention._get_causal_mask_mod()
            block_mask = create_block_mask(mask_mod, batch_size, num_q_heads, q_len, kv_len, _compile=False, device=q.device)
            FlexAttention.block_masks[mask_key] = block_mask
        block_mask = FlexAttention.block_masks[mask_key]
        if sink_weights is None:
            return FlexAttention.flex_attn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        out, lse = FlexAttention.flex_attn(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, return_lse=True)
        attn_scale = torch.sigmoid(lse - sink_weights.view(1, -1, 1)).unsqueeze(-1)  # [B,H,S,1]
        out = out * attn_scale
        return out.to(q.dtype)

    @staticmethod
    def _get_sliding_window_mask_mod(window):
        def sliding_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
            return keep
        return sliding_mod

    @staticmethod
    def _get_causal_mask_mod():
        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        return causal_mask


class GptOssConfig:
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    sliding_window = 5
    num_hidden_layers = 2
    rope_theta = 150000.0


def rope_freqs(head_dim, seqlen, theta):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ang = torch.outer(torch.arange(seqlen).float(), inv)
    return torch.polar(torch.ones_like(ang), ang)


def apply_rotary_emb_qk(q, k, freqs_cis):  # bshd
    def rot(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)
    return rot(q), rot(k)


class GptOssAttention(nn.Module):
    def __init__(self, config, use_sliding_attention=False):
        super().__init__()
        self.sliding_window = config.sliding_window if use_sliding_attention else None
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.q_proj = nn.Linear(self.hidden_size, self.num_attention_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_attention_heads * self.head_dim, self.hidden_size, bias=True)
        self.softmax_scale = self.head_dim ** -0.5
        self.attn_module = FlexAttention()
        self.attn_func = self.attn_module.__call__
        self.sinks = nn.Parameter(torch.randn(self.num_attention_heads))

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.size()
        q = self.q_proj(x).view(bsz, seqlen, self.num_attention_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seqlen, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seqlen, self.num_key_value_heads, self.head_dim)
        q, k = apply_rotary_emb_qk(q, k, freqs_cis)
        updated_attn_kwargs = {
            "scale": self.softmax_scale,
            "sink_weights": self.sinks,
            "sliding_window": (self.sliding_window if self.sliding_window is not None else 0),
            "enable_gqa": True,
        }
        q = q.transpose(1, 2).contiguous()
        k = k.transpose(1, 2).contiguous()
        v = v.transpose(1, 2).contiguous()
        output = self.attn_func(q, k, v, **updated_attn_kwargs)
        output = output.transpose(1, 2).contiguous()
        return self.o_proj(output.flatten(2)), (q, k, v)


def reference(attn, q, k, v):
    # dense double loop: each query over its allowed keys plus one sink logit per head
    B, H, S, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                lo = 0 if attn.sliding_window is None else max(0, i - attn.sliding_window + 1)
                keys = k[b, h // rep, lo:i + 1]
                vals = v[b, h // rep, lo:i + 1]
                logits = torch.cat([keys @ q[b, h, i] * attn.softmax_scale, attn.sinks[h].view(1)])
                p = torch.softmax(logits, 0)[:-1]
                out[b, h, i] = p @ vals
    return attn.o_proj(out.transpose(1, 2).flatten(2))


config = GptOssConfig()
layers = [GptOssAttention(config, use_sliding_attention=(i % 2 == 0)) for i in range(config.num_hidden_layers)]
B, S = 2, 13
x = torch.randn(B, S, config.hidden_size)
freqs_cis = rope_freqs(config.head_dim, S, config.rope_theta)
with torch.no_grad():
    h = x
    for layer in layers:
        y, (q, k, v) = layer(h, freqs_cis)
        ref = reference(layer, q, k, v)
        assert torch.allclose(y, ref, atol=1e-5), (layer.sliding_window, (y - ref).abs().max())
        # each row alone gives the same output (rows never mix)
        for b in range(B):
            yb, _ = layer(h[b:b + 1], freqs_cis)
            assert torch.allclose(yb[0], y[b], atol=1e-5)
        h = h + y
print("ok")
