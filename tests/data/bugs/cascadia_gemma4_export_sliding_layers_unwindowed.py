"""Gemma 4 OpenVINO export: sliding_attention layers masked with a plain causal mask.

Citation: labscommunity/cascadia#151, "fix(gemma4-export): mask sliding_attention layers to
their window" (merged). The buggy code is tools/export_gemma4.py as of release 0.2.0 (read from
the repository snapshot): `cached_gemma4_layer_forward` and `cached_gemma4_shared_layer_forward`
each build

    causal_mask = torch.triu(full((seq_len, full_seq_len), -inf), diagonal=full_seq_len - seq_len + 1)

for every layer, whatever `text_config.layer_types[i]` says, so sliding layers attend to the
whole prefix (the PR: "matches HF only while the sequence stays shorter than the window").
The fix extracts one `build_attention_mask()` shared by both layer-forward paths; sliding layers
get the window band, full_attention layers the plain causal mask. I did not read the fix's diff,
only the PR description; the band here is HF Gemma's (key kept when q_pos - k_pos < window).

This program keeps the exporter's shape: a CachedStageWrapper over a stage's layers, the stage's
layer types and the past K/V passed in as explicit tensors (what the traced OV graph takes),
with a 6-token prefill followed by two single-token decode steps over text_config.sliding_window=3.
The model itself is a tiny random-weight stand-in for Gemma 4's attention (q/k/v/o projections,
rotary omitted): only the mask path matters.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma4TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: [
        "sliding_attention", "sliding_attention", "full_attention",
        "sliding_attention", "sliding_attention", "full_attention",
    ])


class Gemma4Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = Gemma4Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 64), nn.GELU(), nn.Linear(64, cfg.hidden_size))


def build_attention_mask(seq_len, full_seq_len, sliding_window, dtype):
    """Additive mask for the new queries over past + new keys; a band when sliding_window is set."""
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    q_pos = torch.arange(full_seq_len - seq_len, full_seq_len).unsqueeze(1)
    k_pos = torch.arange(full_seq_len).unsqueeze(0)
    keep = k_pos <= q_pos
    if sliding_window is not None:
        keep = keep & (q_pos - k_pos < sliding_window)
    return torch.zeros(seq_len, full_seq_len, dtype=dtype).masked_fill(~keep, float("-inf"))


def cached_gemma4_layer_forward(layer, hidden_states, past_key, past_value, num_heads, num_kv_heads,
                                head_dim, sliding_window):
    bsz, seq_len, _ = hidden_states.shape
    num_kv_groups = num_heads // num_kv_heads
    residual = hidden_states
    hidden_states = layer.input_layernorm(hidden_states)
    q = layer.self_attn.q_proj(hidden_states).view(bsz, seq_len, num_heads, head_dim).transpose(1, 2)
    k = layer.self_attn.k_proj(hidden_states).view(bsz, seq_len, num_kv_heads, head_dim).transpose(1, 2)
    v = layer.self_attn.v_proj(hidden_states).view(bsz, seq_len, num_kv_heads, head_dim).transpose(1, 2)

    k = torch.cat([past_key, k], dim=2)
    v = torch.cat([past_value, v], dim=2)
    k_exp = k.unsqueeze(2).expand(bsz, num_kv_heads, num_kv_groups, -1, head_dim).reshape(bsz, num_heads, -1, head_dim)
    v_exp = v.unsqueeze(2).expand(bsz, num_kv_heads, num_kv_groups, -1, head_dim).reshape(bsz, num_heads, -1, head_dim)

    attn_weights = torch.matmul(q, k_exp.transpose(2, 3))
    full_seq_len = k.shape[2]
    if FIXED:
        causal_mask = build_attention_mask(seq_len, full_seq_len, sliding_window, q.dtype)
    else:
        causal_mask = torch.triu(
            torch.full((seq_len, full_seq_len), float("-inf"), device=q.device, dtype=q.dtype),
            diagonal=full_seq_len - seq_len + 1,
        )
    attn_weights = attn_weights + causal_mask.unsqueeze(0).unsqueeze(0)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, v_exp)
    attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, seq_len, -1)
    hidden_states = residual + layer.self_attn.o_proj(attn_output)
    hidden_states = hidden_states + layer.mlp(hidden_states)
    return hidden_states, k, v


class CachedStageWrapper(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        self.text_config = text_config
        self.embed = nn.Embedding(100, text_config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(text_config) for _ in text_config.layer_types)
        self.lm_head = nn.Linear(text_config.hidden_size, 100, bias=False)
        self._layer_types = list(text_config.layer_types)

    def forward(self, input_ids, position_ids, *past_kv):
        cfg = self.text_config
        h = self.embed(input_ids)
        present_kv = []
        for i, layer in enumerate(self.layers):
            lt = self._layer_types[i]
            window = cfg.sliding_window if lt == "sliding_attention" else None
            h, pk, pv = cached_gemma4_layer_forward(
                layer, h, past_kv[2 * i], past_kv[2 * i + 1],
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, window,
            )
            present_kv.extend([pk, pv])
        return (self.lm_head(h), *present_kv)


def main():
    torch.manual_seed(0)
    cfg = Gemma4TextConfig()
    wrapper = CachedStageWrapper(cfg).eval()
    empty = [torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim) for _ in range(2 * len(cfg.layer_types))]
    input_ids = torch.tensor([[2, 17, 45, 9, 33, 61]])
    with torch.no_grad():
        logits, *kv = wrapper(input_ids, torch.arange(6).unsqueeze(0), *empty)
        tok = logits[:, -1:].argmax(-1)
        generated = [tok.item()]
        for step in range(2):
            pos = torch.tensor([[6 + step]])
            logits, *kv = wrapper(tok, pos, *kv)
            tok = logits[:, -1:].argmax(-1)
            generated.append(tok.item())
    print("fixed" if FIXED else "buggy", "generated", generated, "cache len", kv[0].shape[2])


if __name__ == "__main__":
    main()
