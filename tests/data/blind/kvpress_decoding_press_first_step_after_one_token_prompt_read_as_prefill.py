# NVIDIA/kvpress#243 ("Fix cache position phase detection", merged as commit b59fdb9 "Add is_prefilling function").
#
# kvpress hooks every attention layer (BasePress.__call__ -> register_forward_hook(..., with_kwargs=True)) and
# decides from the layer's `cache_position` whether the forward is the prefill or a decode step. DecodingPress
# (compress the KV cache every `compression_interval` decode steps down to `target_size` keys, here with KnormPress
# scores) skipped a step as "still prefilling" when `cache_position[-1] <= q_len`. cache_position is zero-based, so
# the first decode step after a one-token prompt (cache_position = [1], q_len = 1) was taken for the prefill: it is
# not counted, the per-layer step counter lags by one and the cache is pruned one step later, so the decode steps in
# between attend keys that should already have been evicted.
# Fix: a shared `is_prefilling(cache_position, q_len)` = `cache_position[-1] + 1 == q_len`.
#
# The model is a tiny Llama-style decoder written out in the layout kvpress hooks (transformers 4.5x LlamaAttention
# called with hidden_states / position_embeddings / past_key_values / cache_position keywords), decoded greedily the
# way `generate` does it (cache_position advanced by one per step, position_ids = cache_position).
import logging
import math
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import DynamicCache, LlamaConfig

FIXED = "--fixed" in sys.argv

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------
# model (Llama layout)
# --------------------------------------------------------------------------------------------------------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None,
                **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                cache_position=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids, past_key_values, cache_position, position_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        q_len = inputs_embeds.shape[1]
        causal_mask = None
        if q_len > 1:
            k_len = past_key_values.get_seq_length() + q_len
            allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
            causal_mask = torch.zeros(q_len, k_len).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=True,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values, cache_position, position_ids=None):
        return self.lm_head(self.model(input_ids, past_key_values, cache_position, position_ids))


# --------------------------------------------------------------------------------------------------------------
# kvpress (kvpress/utils.py, presses/base_press.py, scorer_press.py, knorm_press.py, decoding_press.py)
# --------------------------------------------------------------------------------------------------------------
def extract_keys_and_values(cache, layer_idx):
    keys = cache.layers[layer_idx].keys
    values = cache.layers[layer_idx].values
    return keys, values


def is_prefilling(cache_position: torch.Tensor, q_len: int) -> bool:
    """Return whether the current forward pass is the initial prefill."""
    prefilling = cache_position[-1] + 1 == q_len
    return bool(prefilling.item() if isinstance(prefilling, torch.Tensor) else prefilling)


@dataclass
class BasePress:
    def post_init_from_model(self, model):
        pass

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("compress method must be implemented in subclass")

    def forward_hook(self, module, input, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["past_key_values"]
        cache_layer = cache.layers[module.layer_idx]
        q_len = hidden_states.shape[1]

        # Don't compress after pre-filling
        if FIXED:
            if not is_prefilling(kwargs["cache_position"], q_len):
                return output
        else:
            if kwargs["cache_position"][-1] > q_len:
                return output

        keys, values = extract_keys_and_values(cache, module.layer_idx)
        keys, values = self.compress(module, hidden_states, keys, values, output[1], kwargs)
        cache_layer.keys = keys
        cache_layer.values = values
        return output

    @contextmanager
    def __call__(self, model):
        self.post_init_from_model(model)
        hooks = []
        try:
            language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
            for layer in language_model.layers:
                layer.self_attn.rotary_emb = language_model.rotary_emb
                hooks.append(layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True))
            yield
        finally:
            for forward_hook in hooks:
                forward_hook.remove()


@dataclass
class ScorerPress(BasePress):
    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values

        # Compute scores
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)

        # Get indices of KV pairs with the lowest scores
        k_len = keys.shape[2]
        n_kept = int(k_len * (1 - self.compression_ratio))
        indices = scores.topk(n_kept, dim=-1).indices
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)

        # Prune keys and values
        keys = keys.gather(2, indices).contiguous()
        values = values.gather(2, indices).contiguous()
        return keys, values


@dataclass
class KnormPress(ScorerPress):
    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return -keys.norm(dim=-1)


@dataclass
class DecodingPress(BasePress):
    base_press: ScorerPress = None
    compression_interval: int = 512
    target_size: int = 2048
    hidden_states_buffer_size: int = 256

    def __post_init__(self):
        assert isinstance(self.base_press, ScorerPress), "DecodingPress requires a ScorerPress as input"
        self.hidden_states_buffer = defaultdict(list)  # Per-layer buffer
        self.layer_step_counts = defaultdict(int)  # Track step count per layer
        assert self.compression_interval > 0, "compression_interval must be greater than 0"
        assert self.target_size > 0, "target_size must be greater than 0"

    def post_init_from_model(self, model):
        self.base_press.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        k_len = keys.shape[2]
        target_size = self._resolve_target_size(kwargs)
        target_compression_ratio = self._find_target_compression_ratio(k_len, target_size)
        original_compression_ratio = self.base_press.compression_ratio
        self.base_press.compression_ratio = target_compression_ratio
        result = self.base_press.compress(module, hidden_states, keys, values, attentions, kwargs)
        self.base_press.compression_ratio = original_compression_ratio
        return result

    def forward_hook(self, module, input, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["past_key_values"]
        q_len = hidden_states.shape[1]
        layer_idx = module.layer_idx

        # Only operate during decoding phase (after prefilling)
        if FIXED:
            prefilling = is_prefilling(kwargs["cache_position"], q_len)
        else:
            prefilling = kwargs["cache_position"][-1] <= q_len
        if prefilling:
            # We're still in prefilling phase, don't do anything
            return output
        # Add current hidden states to buffer for this layer
        self.hidden_states_buffer[layer_idx].append(hidden_states.detach().clone())
        self.layer_step_counts[layer_idx] += 1

        # Apply compression if we've reached the compression step threshold
        target_size = self._resolve_target_size(kwargs)
        if (self.layer_step_counts[layer_idx] >= self.compression_interval) or (q_len >= target_size):
            cache_layer = cache.layers[module.layer_idx]
            keys, values = extract_keys_and_values(cache, module.layer_idx)

            attentions = output[1] if len(output) > 1 and output[1] is not None else None

            buffered_hidden_states = torch.cat(self.hidden_states_buffer[layer_idx], dim=1)
            keys, values = self.compress(module, buffered_hidden_states, keys, values, attentions, kwargs)
            cache_layer.keys = keys
            cache_layer.values = values

            # Reset step count and clear buffer for this layer
            self.layer_step_counts[layer_idx] = 0
            self.hidden_states_buffer[layer_idx] = []

        self.hidden_states_buffer[layer_idx] = (
            self.hidden_states_buffer[layer_idx][-self.hidden_states_buffer_size :]
            if self.hidden_states_buffer_size > 0
            else []
        )
        return output

    def reset(self):
        self.hidden_states_buffer = defaultdict(list)
        self.layer_step_counts = defaultdict(int)

    @contextmanager
    def __call__(self, model):
        try:
            with super().__call__(model):
                yield
        finally:
            self.reset()

    def _find_target_compression_ratio(self, q_len, target_tokens):
        if q_len <= target_tokens:
            return 0.0
        ratio = 1.0 - (target_tokens / q_len)
        low, high = 0.0, 1.0
        max_iterations = 20
        iteration = 0
        while iteration < max_iterations:
            n_kept = int(q_len * (1 - ratio))
            if n_kept == target_tokens:
                break
            elif n_kept > target_tokens:
                low = ratio
                ratio = (ratio + high) / 2
            else:
                high = ratio
                ratio = (low + ratio) / 2
            iteration += 1
        return ratio

    def _resolve_target_size(self, kwargs):
        return self.target_size


# --------------------------------------------------------------------------------------------------------------
# greedy decoding, as `generate` steps cache_position
# --------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(model, input_ids, max_new_tokens):
    cache = DynamicCache()
    cache_position = torch.arange(input_ids.shape[1])
    generated = []
    step_logits = []
    next_input = input_ids
    for _ in range(max_new_tokens):
        logits = model(next_input, past_key_values=cache, cache_position=cache_position)
        next_token = logits[:, -1].argmax(-1)
        step_logits.append(logits[0, -1])
        generated.append(int(next_token))
        next_input = next_token[:, None]
        cache_position = cache_position[-1:] + 1
    return generated, torch.stack(step_logits), cache.get_seq_length()


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3) if p.dim() > 1 else None

    # unconditional generation: the prompt is the BOS token alone
    input_ids = torch.tensor([[config.bos_token_id]])
    press = DecodingPress(base_press=KnormPress(), compression_interval=4, target_size=4, hidden_states_buffer_size=0)
    with press(model):
        generated, step_logits, cache_len = greedy_generate(model, input_ids, max_new_tokens=12)

    print("generated:", generated)
    print("cache length at the end:", cache_len)
    print("last-step logits[:6]:", [round(v, 4) for v in step_logits[-1, :6].tolist()])
    print("logit checksum:", round(float(step_logits.abs().sum()), 4))


if __name__ == "__main__":
    main()
