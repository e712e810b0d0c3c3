# Citation: NVIDIA-NeMo/Automodel#2377 ("fix(models): make LlamaRotaryEmbedding honor
#   position_ids values"), merge commit ae69c4e94; buggy parent ae69c4e94^.
# Upstream: nemo_automodel/components/models/llama/rope_utils.py (LlamaRotaryEmbedding,
#   apply_rotary_pos_emb) and nemo_automodel/components/models/llama/model.py
#   (LlamaAttention, LlamaDecoderLayer, LlamaModel.forward, LlamaForCausalLM).
# Bug: LlamaRotaryEmbedding.forward keyed only on position_ids.shape[-1] and returned
#   _cos_cache[:seq_len] / _sin_cache[:seq_len], ignoring the position values.  On the
#   non-fused path (rope_fusion=False, as on CPU) any position_ids that are not
#   arange(seq_len) get the wrong rotary phase.  In a cached greedy decode the model
#   sets position_ids = cache_position = [past_len] for each new token, so every
#   decoded query and key is rotated as position 0 while the prompt keys in the
#   cache sit at 0..P-1.
# Fix: size the cache to position_ids.max() + 1 and gather _cos_cache[position_ids] /
#   _sin_cache[position_ids] (the fused TE path keeps the contiguous slice).
# Port notes: trimmed to the non-fused path, torch RMSNorm, SDPA through transformers'
#   ALL_ATTENTION_FUNCTIONS and create_causal_mask (transformers 5 signature), tiny
#   random LlamaConfig, float32, a hand-written greedy loop with a DynamicCache.
import math
import sys
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- rope_utils.py
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)  # [batch, 1, seq_len, head_dim]
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def _get_rope_config(config):
    if hasattr(config, "rope_parameters") and config.rope_parameters:
        rope_params = config.rope_parameters
        base = rope_params.get("rope_theta", 10000.0)
        rope_scaling = rope_params
    else:
        base = getattr(config, "rope_theta", 10000.0)
        rope_scaling = getattr(config, "rope_scaling", {}) or {}
    return base, rope_scaling


def _compute_default_inv_freq(config, device=None):
    base, _ = _get_rope_config(config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial_rotary_factor = getattr(config, "partial_rotary_factor", 1.0)
    dim = int(dim * partial_rotary_factor)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim))
    return inv_freq, 1.0


class LlamaRotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config, device=None, rope_fusion: bool = False):
        super().__init__()
        self.max_seq_len_cached = 0
        self.rope_fusion = rope_fusion
        self.dtype = getattr(config, "torch_dtype", None) or torch.float32
        inv_freq, self.attention_scaling = _compute_default_inv_freq(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("_cos_cache", None, persistent=False)
        self.register_buffer("_sin_cache", None, persistent=False)

    def _build_cache(self, seq_len: int, device: torch.device) -> None:
        """Build cos/sin cache in config dtype for positions [0, seq_len)."""
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim]
        self._cos_cache = (emb.cos() * self.attention_scaling).to(self.dtype)
        self._sin_cache = (emb.sin() * self.attention_scaling).to(self.dtype)

    def _ensure_cache(self, seq_len: int, device: torch.device) -> None:
        if self._cos_cache is None or seq_len > self.max_seq_len_cached:
            self._build_cache(seq_len, device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if not FIXED:
            seq_len = position_ids.shape[-1]

            # Build cache if needed
            if self._cos_cache is None or seq_len > self.max_seq_len_cached:
                self._build_cache(seq_len, x.device)

            # Slice cache and expand for batch
            cos = self._cos_cache[:seq_len].unsqueeze(0).expand(position_ids.shape[0], -1, -1)
            sin = self._sin_cache[:seq_len].unsqueeze(0).expand(position_ids.shape[0], -1, -1)
            return cos, sin

        # Non-fused: gather per-position.
        needed = max(int(position_ids.max().item()) + 1, position_ids.shape[-1])
        self._ensure_cache(needed, x.device)
        cos = self._cos_cache[position_ids]
        sin = self._sin_cache[position_ids]
        return cos, sin


# ---------------------------------------------------------------- model.py
class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings[:2]
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config, rope_fusion=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, cache_position=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if cache_position is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(
                past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device
            )

        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=past_key_values,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states), past_key_values


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=None):
        hidden_states, past_key_values = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return self.lm_head(hidden_states), past_key_values


# ---------------------------------------------------------------- greedy decode
@torch.no_grad()
def greedy_generate(model, input_ids, max_new_tokens):
    logits, cache = model(input_ids, use_cache=True)
    step_logits = [logits[:, -1]]
    next_token = logits[:, -1].argmax(-1, keepdim=True)
    out = [next_token]
    for _ in range(max_new_tokens - 1):
        logits, cache = model(next_token, past_key_values=cache, use_cache=True)
        step_logits.append(logits[:, -1])
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(next_token)
    return torch.cat(out, dim=1), torch.stack(step_logits, dim=1)


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        attention_bias=False,
        use_cache=True,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.3)

    prompt = torch.tensor([[5, 17, 23, 9, 41, 2, 33, 12, 7, 50]])
    tokens, step_logits = greedy_generate(model, prompt, max_new_tokens=8)
    print("generated:", tokens.tolist())
    print("logit checksum per step:", [round(float(x), 4) for x in step_logits.sum(-1)[0]])


if __name__ == "__main__":
    main()
