"""vLLM Gemma 3: the sliding-window layers were given the global layers' linear RoPE scaling.

Citation: vllm-project/vllm#29111 ("[CI Failure] Fix Gemma3 RoPE configuration for sliding attention
layers"), a regression from vllm-project/vllm#28542 (the move to `config.rope_parameters`). Ported from
`vllm/model_executor/models/gemma3.py` (`Gemma3Attention.__init__` / `forward`, `Gemma3DecoderLayer`,
`Gemma3Model`), `vllm/model_executor/layers/rotary_embedding` (`get_rope`, `RotaryEmbedding`,
`LinearScalingRotaryEmbedding`: a cos/sin cache indexed by `positions`, neox style), with the paged
attention backend replaced by a per-request torch loop over the engine's flat batch (query_start_loc,
seq_lens, a per-layer KV cache, `per_layer_sliding_window`).

Bug: with a transformers-v4 style config (one `rope_parameters` dict built from `rope_scaling` and
`rope_theta`, e.g. Gemma 3 4B: linear, factor 8, theta 1e6) the attention module copied the global
dict and only overrode `rope_theta` for the sliding layers, so the local layers kept
`rope_type="linear", factor=8`: their queries and keys were rotated at position / 8.

Fix: sliding layers use `dict(rope_type="default", rope_theta=config.rope_local_base_freq)`, i.e.
unscaled RoPE at the local base; only the full-attention layers keep the linear scaling.

Reproduction: a tiny Gemma 3 text model (5 sliding : 1 full, window 4), two requests prefilled in one
flat batch and decoded greedily for a few steps.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma3TextConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------- rotary embedding
class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        cache = self._compute_cos_sin_cache()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_inv_freq(self, base):
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_cos_sin_cache(self):
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions, query, key):
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query = query.view(num_tokens, -1, self.head_size)
        key = key.view(num_tokens, -1, self.head_size)
        query = _apply_rotary_emb(query, cos, sin, self.is_neox_style)
        key = _apply_rotary_emb(key, cos, sin, self.is_neox_style)
        return query.reshape(num_tokens, -1), key.reshape(num_tokens, -1)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, scaling_factor):
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_cos_sin_cache(self):
        inv_freq = self._compute_inv_freq(self.base)
        max_len = self.max_position_embeddings * self.scaling_factor
        t = torch.arange(int(max_len), dtype=torch.float)
        t = t / self.scaling_factor
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _apply_rotary_emb(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def get_rope(head_size, max_position, rope_parameters, is_neox_style=True):
    base = rope_parameters["rope_theta"]
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return RotaryEmbedding(head_size, head_size, max_position, base, is_neox_style)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(
            head_size, head_size, max_position, base, is_neox_style, rope_parameters["factor"])
    raise ValueError(rope_type)


# ----------------------------------------------------------------------------- engine metadata
class AttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, kv_caches):
        self.query_start_loc = query_start_loc  # [num_reqs + 1] into the flat token axis
        self.seq_lens = seq_lens  # total tokens per request after this step
        self.kv_caches = kv_caches  # layer_name -> list (per request) of (k, v)


_FORWARD_CONTEXT = {}


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size) * 0.1)
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = out * (1.0 + self.weight)
        return out if residual is None else (out, residual)


class Attention(nn.Module):
    """Stand-in for vllm.attention.Attention: writes this step's K/V, attends per request."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, per_layer_sliding_window, prefix):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = per_layer_sliding_window
        self.layer_name = prefix

    def forward(self, q, k, v):
        md = _FORWARD_CONTEXT["attn_metadata"]
        caches = md.kv_caches.setdefault(self.layer_name, [None] * len(md.seq_lens))
        out = torch.empty_like(q)
        qsl = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens.tolist()):
            s, e = qsl[i], qsl[i + 1]
            kk = k[s:e].view(-1, self.num_kv_heads, self.head_size)
            vv = v[s:e].view(-1, self.num_kv_heads, self.head_size)
            if caches[i] is not None:
                kk = torch.cat([caches[i][0], kk])
                vv = torch.cat([caches[i][1], vv])
            caches[i] = (kk, vv)
            qq = q[s:e].view(-1, self.num_heads, self.head_size)
            q_len = e - s
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask = mask & (q_pos - k_pos < self.sliding_window)
            rep = self.num_heads // self.num_kv_heads
            o = F.scaled_dot_product_attention(
                qq.transpose(0, 1),
                kk.repeat_interleave(rep, dim=1).transpose(0, 1),
                vv.repeat_interleave(rep, dim=1).transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[s:e] = o.transpose(0, 1).reshape(q_len, -1)
        return out


class Gemma3Attention(nn.Module):
    def __init__(self, config, hidden_size, num_heads, num_kv_heads, head_dim, max_position_embeddings,
                 prefix=""):
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5

        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

        layer_idx = int(prefix.split(".")[-2])
        layer_type = config.layer_types[layer_idx]
        self.is_sliding = layer_type == "sliding_attention"
        sliding_window = config.sliding_window if self.is_sliding else None

        # Initialize the rotary embedding.
        if layer_type in config.rope_parameters:
            # Transformers v5 rope config.
            rope_parameters = config.rope_parameters[layer_type]
        elif FIXED:
            # Transformers v4 rope config.
            # Global attention. Use the values in config.json.
            rope_parameters = config.rope_parameters
            # Local attention. Override the values in config.json.
            if self.is_sliding:
                rope_parameters = dict(rope_type="default", rope_theta=config.rope_local_base_freq)
        else:
            # Transformers v4 rope config.
            # Global attention. Use the values in config.json.
            rope_parameters = config.rope_parameters.copy()
            # Local attention. Override the values in config.json.
            if self.is_sliding:
                rope_parameters["rope_theta"] = config.rope_local_base_freq

        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position_embeddings,
            rope_parameters=rope_parameters,
            is_neox_style=True,
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                              per_layer_sliding_window=sliding_window, prefix=f"{prefix}.attn")

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        q = self.q_norm(q)
        q = q.flatten(-2, -1)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        k = self.k_norm(k)
        k = k.flatten(-2, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        return self.o_proj(attn_output)


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, prefix=""):
        super().__init__()
        self.self_attn = Gemma3Attention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Gemma3MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return hidden_states, residual


class Gemma3Model(nn.Module):
    def __init__(self, config, prefix="model"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(config, prefix=f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5))

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def build_config():
    config = Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        max_position_embeddings=64, query_pre_attn_scalar=16,
    )
    # A transformers-v4 style Gemma 3 4B config as vLLM normalises it: one rope dict built from
    # `rope_scaling` + `rope_theta`, and the local base in its own field.
    config.rope_parameters = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    config.rope_local_base_freq = 10_000.0
    return config


@torch.no_grad()
def main():
    config = build_config()
    model = Gemma3Model(config).eval()
    lm_head = torch.randn(config.vocab_size, config.hidden_size) * 0.2  # untied head

    prompts = [[5, 17, 33, 2, 61, 8, 44, 90, 12], [71, 3, 3, 28, 50, 19, 66, 7, 81, 40, 9, 55]]
    kv_caches = {}
    num_computed = [0, 0]
    step_tokens = [list(p) for p in prompts]
    generated = [[], []]
    for step in range(5):
        input_ids, positions, qsl, seq_lens = [], [], [0], []
        for i, toks in enumerate(step_tokens):
            input_ids += toks
            positions += list(range(num_computed[i], num_computed[i] + len(toks)))
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(num_computed[i] + len(toks))
        _FORWARD_CONTEXT["attn_metadata"] = AttentionMetadata(
            torch.tensor(qsl), torch.tensor(seq_lens), kv_caches)
        hidden = model(torch.tensor(input_ids), torch.tensor(positions))
        last = hidden[torch.tensor(qsl[1:]) - 1]
        logits = last @ lm_head.T
        if step == 0:
            print("prefill last-token logits[:4]", [[round(x, 4) for x in r[:4].tolist()] for r in logits])
        next_tokens = logits.argmax(-1).tolist()
        for i in range(2):
            num_computed[i] = seq_lens[i]
            generated[i].append(next_tokens[i])
            step_tokens[i] = [next_tokens[i]]
    print("generated", generated)


if __name__ == "__main__":
    main()
