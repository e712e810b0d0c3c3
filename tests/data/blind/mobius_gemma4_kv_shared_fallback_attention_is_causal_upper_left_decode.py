"""mobius Gemma 4: KV-shared layers ran the ONNX Attention op with is_causal=1 on top of a full bias.

Citation: onnxruntime/mobius commit f93778e2 ("fix(gemma4): use float-bias causal masking for
KV-shared attention fallback"), src/mobius/models/gemma4.py ``Gemma4TextAttention.forward``.

Gemma 4's last ``num_kv_shared_layers`` layers own no K/V projections: each borrows the present
K/V of the last earlier layer of its own type (sliding or full). In the non-GQA graph (the
fallback ``Attention`` path) the shared layer hands the source layer's FULL present K/V to the
ONNX Attention op as key/value with no past, together with the float bias from
``create_attention_bias`` (causal + sliding window + padding, bottom-right aligned on the
attention_mask cumsum). Before the fix it also passed the caller's ``is_causal`` (1), so the op
applied its own causal mask on top. Per the ONNX spec that mask is upper-left aligned over
(q_len, kv_len) when there is no past, which the CUDA EP follows: during decode (q_len 1,
kv_len = whole sequence) the shared layers' single query could see kv[0] only.

The fix passes ``is_causal=0`` on the shared layers' fallback path, so causality comes only from
the float bias.

Kept from mobius: Gemma4TextAttention (per-head q/k RMSNorm, parameterless V norm, scale 1.0,
KV sharing by reverse scan over ``layer_types[:first_kv_shared_layer_idx]``, the
Transpose/Reshape of the shared BNSH buffer to 3-D), ``_apply_attention`` (ONNX Attention with
past concatenation), ``create_attention_bias``, the decoder layer's pre/post norms, and the
text model's per-layer-type bias dict and shared_kv_states. ONNX ops are rendered with torch;
the Attention op is written as the CUDA EP computes it (causal mask offset by the past length,
so upper-left when no past is given). The model is driven as onnxruntime-genai drives it:
input_ids / attention_mask / position_ids / past key values, greedy search. Tiny random
weights; attention logit softcapping is switched off in this config.
"""

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class Gemma4Config:
    vocab_size: int = 97
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_global_key_value_heads: int | None = None
    head_dim: int = 16
    global_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    global_partial_rotary_factor: float = 0.25
    sliding_window: int = 4
    num_kv_shared_layers: int = 2
    attn_logit_softcapping: float = 0.0
    attention_k_eq_v: bool = False
    rope_interleave: bool = False
    layer_types: list = field(
        default_factory=lambda: [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ]
    )


# ---------------------------------------------------------------------------
# components/_common.py
# ---------------------------------------------------------------------------


def create_attention_bias(input_ids, attention_mask, sliding_window=None, dtype=torch.float32):
    """Causal (+ sliding) (+ padding) additive bias, (batch, 1, query_length, total_length)."""
    all_indices = torch.cumsum(attention_mask, 1)
    kv_indices = all_indices.unsqueeze(1)
    query_length = input_ids.shape[1]
    total_length = attention_mask.shape[1]
    start = total_length - query_length
    q_indices_2d = all_indices[:, start:total_length]
    q_indices = q_indices_2d.unsqueeze(2)

    full_mask = q_indices >= kv_indices
    if sliding_window is not None:
        dist = q_indices - kv_indices
        within_window = dist < sliding_window
        full_mask = full_mask & within_window

    attn_mask_bool = attention_mask.unsqueeze(1).to(torch.bool)
    full_mask = attn_mask_bool & full_mask

    mask_value = torch.finfo(dtype).min
    attention_bias = torch.where(full_mask, 0.0, mask_value).to(dtype)
    return attention_bias.unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight).to(x.dtype)


# ---------------------------------------------------------------------------
# components/_attention.py
# ---------------------------------------------------------------------------


def _onnx_attention(
    query,
    key,
    value,
    attn_mask,
    past_key,
    past_value,
    *,
    q_num_heads,
    kv_num_heads,
    scale,
    softcap,
    is_causal,
):
    """ONNX ``Attention`` (opset 24, 3-D Q/K/V, 4-D BNSH past/present) as the CUDA EP runs it."""
    batch, q_len, _ = query.shape
    q = query.reshape(batch, q_len, q_num_heads, -1).transpose(1, 2)
    k = key.reshape(batch, key.shape[1], kv_num_heads, -1).transpose(1, 2)
    v = value.reshape(batch, value.shape[1], kv_num_heads, -1).transpose(1, 2)
    past_len = 0
    if past_key is not None:
        past_len = past_key.shape[2]
        k = torch.cat([past_key, k], dim=2)
        v = torch.cat([past_value, v], dim=2)
    present_key, present_value = k, v
    kv_len = k.shape[2]

    group = q_num_heads // kv_num_heads
    k_rep = k.repeat_interleave(group, dim=1)
    v_rep = v.repeat_interleave(group, dim=1)

    qk = torch.matmul(q, k_rep.transpose(-1, -2)) * scale
    attn_bias = torch.zeros(q_len, kv_len, dtype=qk.dtype)
    if is_causal:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool).tril(past_len)
        attn_bias = attn_bias.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_bias = attn_bias.masked_fill(~attn_mask, float("-inf"))
        else:
            attn_bias = attn_bias + attn_mask
    if softcap:
        qk = softcap * torch.tanh(qk / softcap)
    probs = torch.softmax(qk + attn_bias, dim=-1)
    out = torch.matmul(probs, v_rep)
    out = out.transpose(1, 2).reshape(batch, q_len, -1)
    return out, present_key, present_value


def _apply_attention(
    query,
    key,
    value,
    attn_mask,
    past_key,
    past_value,
    *,
    num_attention_heads,
    num_key_value_heads,
    scale,
    softcap=0.0,
    is_causal=1,
):
    attn_output, present_key, present_value = _onnx_attention(
        query,
        key,
        value,
        attn_mask,
        past_key,
        past_value,
        q_num_heads=num_attention_heads,
        kv_num_heads=num_key_value_heads,
        scale=scale,
        softcap=softcap,
        is_causal=is_causal,
    )
    return attn_output, present_key, present_value


def apply_rotary_pos_emb(x, position_embeddings, num_heads, rotary_embedding_dim, interleaved):
    cos, sin = position_embeddings  # (batch, seq, rot_dim // 2)
    batch, seq, _ = x.shape
    x = x.reshape(batch, seq, num_heads, -1)
    head_dim = x.shape[-1]
    rot = rotary_embedding_dim or head_dim
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([rotated, x_pass], dim=-1).reshape(batch, seq, -1)


class Gemma4RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base, partial_rotary_factor):
        super().__init__()
        rot = int(head_dim * partial_rotary_factor)
        self.rotary_embedding_dim = rot
        inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2).float() / rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        return torch.cos(freqs), torch.sin(freqs)


# ---------------------------------------------------------------------------
# models/gemma4.py
# ---------------------------------------------------------------------------


class Gemma4TextAttention(nn.Module):
    def __init__(self, config, layer_idx, layer_types, first_kv_shared_layer_idx, head_dim, rotary_embedding_dim):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = head_dim
        self.scaling = 1.0
        self.softcap = config.attn_logit_softcapping
        self._v_norm_eps = config.rms_norm_eps
        self.rotary_embedding_dim = rotary_embedding_dim
        self._rope_interleave = config.rope_interleave
        self.layer_idx = layer_idx

        is_sliding = layer_types[layer_idx] == "sliding_attention"
        self._use_alternative_attention = getattr(config, "attention_k_eq_v", False) and not is_sliding
        if not is_sliding and config.num_global_key_value_heads is not None:
            self.num_key_value_heads = config.num_global_key_value_heads
        else:
            self.num_key_value_heads = config.num_key_value_heads

        self.is_kv_shared_layer = layer_idx >= first_kv_shared_layer_idx > 0
        prev_layers = layer_types[:first_kv_shared_layer_idx]
        if self.is_kv_shared_layer:
            self.kv_shared_layer_index = len(prev_layers) - 1 - prev_layers[::-1].index(layer_types[layer_idx])
            self.provides_shared_kv = False
        else:
            self.kv_shared_layer_index = None
            self.provides_shared_kv = first_kv_shared_layer_idx > 0 and (
                layer_idx == len(prev_layers) - 1 - prev_layers[::-1].index(layer_types[layer_idx])
            )

        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, config.hidden_size, bias=False)
        if not self.is_kv_shared_layer:
            self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * head_dim, bias=False)
            if not self._use_alternative_attention:
                self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * head_dim, bias=False)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)

    def _v_norm(self, value_raw):
        b, s, _ = value_raw.shape
        value_states = value_raw.reshape(b, s, self.num_key_value_heads, self.head_dim)
        v_f32 = value_states.float()
        rms = torch.sqrt((v_f32 * v_f32).mean(-1, keepdim=True) + self._v_norm_eps)
        return (v_f32 / rms).to(value_raw.dtype).reshape(b, s, -1)

    def forward(self, hidden_states, attention_bias, position_embeddings=None, shared_kv_states=None,
                past_key_value=None, is_causal=1):
        b, s, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states)
        query_states = query_states.reshape(b, s, -1, self.head_dim)
        query_states = self.q_norm(query_states)
        query_states = query_states.reshape(b, s, -1)
        if position_embeddings is not None:
            query_states = apply_rotary_pos_emb(
                query_states, position_embeddings, self.num_attention_heads,
                self.rotary_embedding_dim, self._rope_interleave,
            )

        if self.is_kv_shared_layer:
            src_key, src_value = shared_kv_states[self.kv_shared_layer_index]
            # Fallback Attention path: transpose shared KV from BNSH to 3D.
            src_key = src_key.permute(0, 2, 1, 3)
            src_key = src_key.reshape(src_key.shape[0], src_key.shape[1], -1)
            src_value = src_value.permute(0, 2, 1, 3)
            src_value = src_value.reshape(src_value.shape[0], src_value.shape[1], -1)

            attn_output, present_key, present_value = _apply_attention(
                query_states,
                src_key,
                src_value,
                attention_bias,
                past_key=None,
                past_value=None,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads,
                scale=self.scaling,
                softcap=self.softcap,
                is_causal=0 if FIXED else is_causal,
            )
        else:
            key_raw = self.k_proj(hidden_states)
            key_states = key_raw.reshape(b, s, -1, self.head_dim)
            key_states = self.k_norm(key_states)
            key_states = key_states.reshape(b, s, -1)
            if position_embeddings is not None:
                key_states = apply_rotary_pos_emb(
                    key_states, position_embeddings, self.num_key_value_heads,
                    self.rotary_embedding_dim, self._rope_interleave,
                )
            value_raw = key_raw if self._use_alternative_attention else self.v_proj(hidden_states)
            value_states = self._v_norm(value_raw)

            attn_output, present_key, present_value = _apply_attention(
                query_states,
                key_states,
                value_states,
                attention_bias,
                past_key_value[0] if past_key_value is not None else None,
                past_key_value[1] if past_key_value is not None else None,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads,
                scale=self.scaling,
                softcap=self.softcap,
                is_causal=is_causal,
            )
            if self.provides_shared_kv and shared_kv_states is not None:
                shared_kv_states[self.layer_idx] = (present_key, present_value)

        attn_output = self.o_proj(attn_output)
        return attn_output, (present_key, present_value)


class Gemma4MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, first_kv_shared):
        super().__init__()
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        head_dim = config.head_dim if is_sliding else config.global_head_dim
        rot = 0 if is_sliding else int(head_dim * config.global_partial_rotary_factor)
        self.self_attn = Gemma4TextAttention(
            config, layer_idx, config.layer_types, first_kv_shared, head_dim, rot
        )
        self.mlp = Gemma4MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_bias, position_embeddings, shared_kv_states,
                past_key_value, is_causal=1):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_output, present_key_value = self.self_attn(
            hidden_states,
            attention_bias=attention_bias,
            position_embeddings=position_embeddings,
            shared_kv_states=shared_kv_states,
            past_key_value=past_key_value,
            is_causal=is_causal,
        )
        hidden_states = self.post_attention_layernorm(attn_output)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states, present_key_value


class Gemma4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer_types = config.layer_types
        self.sliding_window = config.sliding_window
        self._dtype = torch.float32
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        first_kv_shared = config.num_hidden_layers - config.num_kv_shared_layers
        self.layers = nn.ModuleList(
            [Gemma4DecoderLayer(config, i, first_kv_shared) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb_local = Gemma4RotaryEmbedding(config.head_dim, config.rope_local_base_freq, 1.0)
        self.rotary_emb_global = Gemma4RotaryEmbedding(
            config.global_head_dim, config.rope_theta, config.global_partial_rotary_factor
        )

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        hidden_states = self.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)

        # non-GQA graph: the float-bias fallback for every layer
        attn_is_causal = 1
        position_embeddings_dict = {
            "sliding_attention": self.rotary_emb_local(position_ids),
            "full_attention": self.rotary_emb_global(position_ids),
        }
        query_input = input_ids
        fallback_bias_dict = {
            "sliding_attention": create_attention_bias(
                query_input, attention_mask, sliding_window=self.sliding_window, dtype=self._dtype
            ),
            "full_attention": create_attention_bias(query_input, attention_mask, dtype=self._dtype),
        }

        shared_kv_states: dict = {}
        present_key_values = []
        if past_key_values is not None:
            kv_iter = iter(past_key_values)
            past_kvs = [None if layer.self_attn.is_kv_shared_layer else next(kv_iter) for layer in self.layers]
        else:
            past_kvs = [None] * len(self.layers)

        for layer, layer_type, past_kv in zip(self.layers, self.layer_types, past_kvs):
            hidden_states, present_kv = layer(
                hidden_states,
                attention_bias=fallback_bias_dict[layer_type],
                position_embeddings=position_embeddings_dict[layer_type],
                shared_kv_states=shared_kv_states,
                past_key_value=past_kv,
                is_causal=attn_is_causal,
            )
            if not layer.self_attn.is_kv_shared_layer:
                present_key_values.append(present_kv)

        hidden_states = self.norm(hidden_states)
        return hidden_states, present_key_values


class Gemma4CausalLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Gemma4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        hidden_states, present = self.model(input_ids, attention_mask, position_ids, past_key_values)
        return self.lm_head(hidden_states), present


# ---------------------------------------------------------------------------
# onnxruntime-genai style greedy loop over the exported decoder
# ---------------------------------------------------------------------------


def generate(model, prompt_ids, max_new_tokens):
    input_ids = prompt_ids
    total = prompt_ids.shape[1]
    attention_mask = torch.ones(1, total, dtype=torch.long)
    position_ids = torch.arange(total).unsqueeze(0)
    past = None
    tokens = []
    step_logits = []
    for _ in range(max_new_tokens):
        logits, past = model(input_ids, attention_mask, position_ids, past)
        last = logits[:, -1, :]
        step_logits.append(last)
        next_token = last.argmax(-1, keepdim=True)
        tokens.append(int(next_token))
        total += 1
        input_ids = next_token
        attention_mask = torch.ones(1, total, dtype=torch.long)
        position_ids = torch.tensor([[total - 1]])
    return tokens, torch.cat(step_logits)


def main():
    config = Gemma4Config()
    model = Gemma4CausalLMModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0.0, 0.05)
            elif p.dim() == 2:
                p.normal_(0.0, 0.3)
    prompt = torch.tensor([[5, 17, 42, 8, 61, 23, 9, 77, 30, 12]])
    with torch.no_grad():
        tokens, logits = generate(model, prompt, max_new_tokens=8)
    print("fixed" if FIXED else "buggy", "generated:", tokens)
    print("decode-step logits checksum: %.6f" % logits[1:].abs().sum().item())


if __name__ == "__main__":
    main()
