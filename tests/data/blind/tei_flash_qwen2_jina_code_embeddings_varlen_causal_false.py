# huggingface/text-embeddings-inference#762 (commit 9255309, "Add support on `model_type=qwen2` for causal
# attention"), backends/candle/src/models/flash_qwen2.rs + models/qwen2.rs, ported to torch.
#
# TEI's FlashQwen2Model was written for Alibaba-NLP/gte-Qwen2-*-instruct, which is trained bidirectionally, so
# Qwen2Attention called flash_attn_varlen(..., causal=false) for every qwen2 checkpoint. Newer Qwen2-based embedders
# (jinaai/jina-code-embeddings-0.5b, nomic-ai/nomic-embed-code) are causal decoders with last-token pooling; TEI
# loaded them and served embeddings computed with bidirectional attention inside each packed sequence.
# Fix: Qwen2Config gains `is_causal` (serde default true, with a warning) and Qwen2Attention passes
# `self.is_causal` to flash_attn_varlen.
#
# `python FILE` runs the code before the fix; `python FILE --fixed` after it.
import math
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import List, Optional

import torch
import torch.nn.functional as F
import transformers

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- backends/candle/src/models/qwen2.rs
def default_is_causal() -> bool:
    warnings.warn(
        "is_causal not set in Qwen2Config, defaulting to true. e.g. Alibaba-NLP/gte-Qwen2-1.5B-instruct/ was trained "
        "with causal=False attention, but jinaai/jina-code-embeddings-0.5b with causal=True. Please set this field "
        "explicitly in the huggingface repo to avoid this warning."
    )
    return True


@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: Optional[int]
    use_sliding_window: bool

    @classmethod
    def deserialize(cls, config_json: dict) -> "Qwen2Config":
        # serde: unknown keys are ignored, missing keys with `#[serde(default = ...)]` take the default
        names = [f.name for f in fields(cls)]
        cfg = cls(**{n: config_json.get(n) for n in names})
        if FIXED:
            cfg.is_causal = config_json["is_causal"] if "is_causal" in config_json else default_is_causal()
        return cfg


# ---------------------------------------------------------------- backends/candle/src/flash_attn.rs
def flash_attn_varlen(q, k, v, alibi_slopes, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, window_size_left, window_size_right):
    """CPU stand-in for candle_flash_attn::flash_attn_varlen_windowed on [tokens, heads, head_size] tensors.

    `causal` becomes window_size_right = Some(0) as TEI does; a key j is visible to query i of the same
    sequence when j <= i + window_size_right (and i - j <= window_size_left)."""
    if causal:
        window_size_right = 0
    n_heads, n_kv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = seqlens_q.tolist(), seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]]
        vs = v[cu_k[b]:cu_k[b + 1]]
        ks = ks.repeat_interleave(n_heads // n_kv, dim=1)
        vs = vs.repeat_interleave(n_heads // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * softmax_scale
        lq, lk = qs.shape[0], ks.shape[0]
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if window_size_right is not None:
            visible &= j <= i + window_size_right
        if window_size_left is not None:
            visible &= j >= i - window_size_left
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1)
        out[cu_q[b]:cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vs.float()).to(q.dtype)
    return out


# ---------------------------------------------------------------- backends/candle/src/layers
def get_inv_freqs(dim, base):
    return torch.tensor([1.0 / base ** (i / dim) for i in range(0, dim, 2)]).reshape(1, -1)


def get_cos_sin(length, inv_freqs, dtype, repeat_freqs):
    t = torch.arange(length, dtype=torch.float32).reshape(length, 1)
    freqs = t @ inv_freqs
    if repeat_freqs:
        freqs = torch.cat([freqs, freqs], 1)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary_inplace(q, k, cos, sin, is_neox):
    # candle_rotary: cos / sin are [tokens, head_size / 2]; neox layout rotates the two halves
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        c, s = cos[:, None, :], sin[:, None, :]
        x[..., :half] = x1 * c - x2 * s
        x[..., half:] = x2 * c + x1 * s


class RMSNorm:
    def __init__(self, weight, epsilon):
        self.weight, self.epsilon = weight, epsilon

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states = hidden_states + residual
        residual_add = hidden_states
        var = hidden_states.float().pow(2).mean(-1, keepdim=True)
        normed = hidden_states.float() / torch.sqrt(var + self.epsilon)
        return (normed * self.weight).to(hidden_states.dtype), residual_add


class Linear:
    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


# ---------------------------------------------------------------- backends/candle/src/models/flash_qwen2.rs
class Qwen2Attention:
    def __init__(self, vb, prefix, config: Qwen2Config):
        if config.use_sliding_window:
            raise ValueError("Sliding window is not supported for Qwen2")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        qkv_weight = torch.cat([vb[f"{prefix}.q_proj.weight"], vb[f"{prefix}.k_proj.weight"],
                                vb[f"{prefix}.v_proj.weight"]], 0)
        qkv_bias = torch.cat([vb[f"{prefix}.q_proj.bias"], vb[f"{prefix}.k_proj.bias"], vb[f"{prefix}.v_proj.bias"]], 0)
        self.qkv_linear = Linear(qkv_weight, qkv_bias)
        self.o_proj = Linear(vb[f"{prefix}.o_proj.weight"], None)
        self.softmax_scale = 1.0 / math.sqrt(self.attention_head_size)
        if FIXED:
            self.is_causal = config.is_causal

    def forward(self, hidden_states, cu_seqlens, cos, sin, max_s):
        qkv = self.qkv_linear.forward(hidden_states)
        qkv = qkv.reshape(qkv.shape[0], self.num_attention_heads + 2 * self.num_key_value_heads,
                          self.attention_head_size)
        q = qkv[:, :self.num_attention_heads].clone()
        k = qkv[:, self.num_attention_heads:self.num_attention_heads + self.num_key_value_heads].clone()
        v = qkv[:, self.num_attention_heads + self.num_key_value_heads:]

        apply_rotary_inplace(q, k, cos, sin, True)

        attention = flash_attn_varlen(
            q, k, v, None, cu_seqlens, cu_seqlens, max_s, max_s, self.softmax_scale,
            self.is_causal if FIXED else False,
            None, None,
        )
        attention = attention.flatten(-2)
        return self.o_proj.forward(attention)


class Qwen2MLP:
    def __init__(self, vb, prefix, config):
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(torch.cat([vb[f"{prefix}.gate_proj.weight"], vb[f"{prefix}.up_proj.weight"]], 0),
                                   None)
        self.down_proj = Linear(vb[f"{prefix}.down_proj.weight"], None)

    def forward(self, hidden_states):
        gate_up_states = self.gate_up_proj.forward(hidden_states)
        gate_states = gate_up_states[:, :self.intermediate_size]
        up_states = gate_up_states[:, self.intermediate_size:]
        return self.down_proj.forward(F.silu(gate_states) * up_states)


class Qwen2Layer:
    def __init__(self, vb, prefix, config):
        self.attention = Qwen2Attention(vb, f"{prefix}.self_attn", config)
        self.mlp = Qwen2MLP(vb, f"{prefix}.mlp", config)
        self.input_layer_norm = RMSNorm(vb[f"{prefix}.input_layernorm.weight"], config.rms_norm_eps)
        self.post_attention_layer_norm = RMSNorm(vb[f"{prefix}.post_attention_layernorm.weight"], config.rms_norm_eps)

    def forward(self, hidden_states, residual, cu_seqlens, cos, sin, max_s):
        normed_hidden_states, res = self.input_layer_norm.forward(hidden_states, residual)
        attn_output = self.attention.forward(normed_hidden_states, cu_seqlens, cos, sin, max_s)
        normed_attn_res_output, attn_res = self.post_attention_layer_norm.forward(attn_output, res)
        mlp_output = self.mlp.forward(normed_attn_res_output)
        return mlp_output, attn_res


@dataclass
class Batch:
    # text_embeddings_backend_core::Batch: requests packed one after another, no padding
    input_ids: List[int]
    token_type_ids: List[int]
    position_ids: List[int]
    cumulative_seq_lengths: List[int]
    max_length: int
    pooled_indices: List[int]
    raw_indices: List[int] = field(default_factory=list)


class FlashQwen2Model:
    def __init__(self, vb, config: Qwen2Config, pool: str):
        if "model.embed_tokens.weight" in vb:
            vb = {k[len("model."):]: t for k, t in vb.items() if k.startswith("model.")}
        self.embeddings = vb["embed_tokens.weight"]
        self.layers = [Qwen2Layer(vb, f"layers.{i}", config) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(vb["norm.weight"], config.rms_norm_eps)
        inv_freqs = get_inv_freqs(self.layers[0].attention.attention_head_size, config.rope_theta)
        self.cos_cache, self.sin_cache = get_cos_sin(config.max_position_embeddings, inv_freqs, torch.float32, False)
        self.pool = pool

    def forward(self, batch: Batch):
        batch_size = len(batch.cumulative_seq_lengths) - 1
        input_ids = torch.tensor(batch.input_ids)
        position_ids = torch.tensor(batch.position_ids)
        cu_seqlens = torch.tensor(batch.cumulative_seq_lengths, dtype=torch.int32)

        hidden_states = F.embedding(input_ids, self.embeddings)
        cos = self.cos_cache.index_select(0, position_ids)
        sin = self.sin_cache.index_select(0, position_ids)

        residual = None
        for layer in self.layers:
            hidden_states, residual = layer.forward(hidden_states, residual, cu_seqlens, cos, sin, batch.max_length)
        outputs, _ = self.norm.forward(hidden_states, residual)

        if self.pool == "last_token":
            if batch_size > 1:
                end = cu_seqlens[1:batch_size + 1].long()
                indices = end - torch.ones_like(end)
                return outputs.index_select(0, indices)
            return outputs[batch.cumulative_seq_lengths[1] - 1].unsqueeze(0)
        raise NotImplementedError(self.pool)


def main():
    torch.manual_seed(0)
    # config.json as jinaai/jina-code-embeddings-0.5b ships it (tiny sizes): model_type qwen2, no `is_causal` key
    config_json = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
    }
    hf_config = transformers.Qwen2Config(**{k: v for k, v in config_json.items() if k != "architectures"})
    vb = {k: t.detach() for k, t in transformers.Qwen2ForCausalLM(hf_config).state_dict().items()}

    config = Qwen2Config.deserialize(config_json)
    model = FlashQwen2Model(vb, config, pool="last_token")  # 1_Pooling/config.json: pooling_mode_lasttoken

    requests = [[5, 17, 33, 2, 90, 41, 7, 100], [12, 64, 3, 77, 8], [99, 1, 45, 23, 60, 11]]
    input_ids, position_ids, cu = [], [], [0]
    for ids in requests:
        input_ids += ids
        position_ids += list(range(len(ids)))
        cu.append(cu[-1] + len(ids))
    batch = Batch(input_ids=input_ids, token_type_ids=[0] * len(input_ids), position_ids=position_ids,
                  cumulative_seq_lengths=cu, max_length=max(len(r) for r in requests),
                  pooled_indices=list(range(len(requests))))

    with torch.no_grad():
        embeddings = F.normalize(model.forward(batch), dim=-1)
    print("embeddings[:, :6]:")
    print(embeddings[:, :6])
    print("cosine similarities:")
    print(embeddings @ embeddings.T)


if __name__ == "__main__":
    main()
