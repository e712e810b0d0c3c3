"""QEfficient Gemma 4: the sliding layers' ring KV cache writes one slot ahead after two windows.

Citation: quic/efficient-transformers#1250 (commit 5b1b4845b, "Gemma4 sliding window bug fix:
Removed the position_ids+1 update for gemma4 SWA"; supersedes the closed #1235),
QEfficient/transformers/cache_utils.py QEffGemma4DynamicLayer.update.

The bug: a sliding_attention layer keeps a ring of `sliding_window` slots and the text model builds
its mask with `_create_causal_mask(position_ids, target_length, sliding_window)`, which reads slot s
as the position p with p % W == s (the rolling-buffer block of modeling_attn_mask_utils.py). But
`QEffGemma4DynamicLayer.update` scattered the new key at `(position_ids + 1) % W` once
`position_ids.max() >= (W - 1) * 2`, and gathered the ring rotated by `kv_position_ids.max() + 1`
once `position_ids.max() >= W - 1`. From then on a decode step overwrites the oldest key still in
the window with the new one and leaves a key from before the window in the slot the mask reads as
the current position, so the query attends a stale key and loses one inside its window.

The fix: scatter at `position_ids % W` and gather the slots in order (0 .. ctx_len - 1, invalid past
`position_ids.max()`), the same layout the mask assumes.

Trimmed port at toy sizes: transformers' Gemma4TextConfig (2 layers: sliding, full; sliding_window
4), QEff's eager text attention (bool mask, True = masked, where(mask, -inf, scores)), the
CtxScatter/CtxGather ops' torch forwards, and the export-style loop: preallocated zero caches
(sliding layer W slots, full layer ctx_len 16) passed in and returned as legacy tuples. Rotary is
the default rope with each layer type's theta (the full layers' proportional partial rope is not
ported). A 4-token prompt is prefilled, then 8 greedy decode steps.
"""

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma4TextConfig

FIXED = "--fixed" in sys.argv

MIN_MASKED_ATTENTION_VALUE = float("-inf")  # QEfficient/utils/constants.py


# ---- QEfficient/customop/ctx_scatter_gather.py (torch forwards) ------------------------------
class CtxScatterFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, position_ids, updates):
        batch_idx = torch.arange(data.shape[0]).view(-1, 1, 1)
        head_idx = torch.arange(data.shape[1]).view(1, -1, 1)
        ctx_idx = position_ids.unsqueeze(1)
        data[batch_idx, head_idx, ctx_idx] = updates
        return data


class CtxGatherFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, ctx_indices, comp_ctx_len):
        batch_indices = torch.arange(data.shape[0]).view(-1, 1, 1)
        head_indices = torch.arange(data.shape[1]).view(1, -1, 1)
        ctx_indices = torch.where(ctx_indices == torch.iinfo(torch.int32).max, 0, ctx_indices)
        return data[batch_indices, head_indices, ctx_indices]


def ctx_scatter(data, position_ids, updates):
    return CtxScatterFunc.apply(data, position_ids, updates)


def ctx_gather(data, ctx_indices, comp_ctx_len):
    return CtxGatherFunc.apply(data, ctx_indices, comp_ctx_len)


# ---- QEfficient/transformers/cache_utils.py ---------------------------------------------------
class InvalidIndexProvider:
    @classmethod
    def _get_invalid_idx_value(cls):
        return 0  # outside ONNX export


def _remainder_with_symbolic_divisor(value, divisor):
    divisor_tensor = torch.scalar_tensor(divisor, dtype=value.dtype, device=value.device)
    return torch.remainder(value, divisor_tensor)


class QEffDynamicLayer:
    def __init__(self):
        self.keys = None
        self.values = None

    def update(self, key_states, value_states, cache_kwargs=None):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        position_ids = cache_kwargs.get("position_ids")
        self.keys = ctx_scatter(self.keys, position_ids, key_states)
        self.values = ctx_scatter(self.values, position_ids, value_states)
        k_out, v_out = self.keys, self.values

        ctx_len = cache_kwargs.get("CCL", k_out.shape[2])
        ctx_indices = torch.arange(ctx_len, dtype=position_ids.dtype)[None, None, ...]
        gather_limit = position_ids.max(1, keepdim=True).values.unsqueeze(1).to(torch.int32)
        invalid_mask = ctx_indices > gather_limit
        invalid_idx_value = InvalidIndexProvider._get_invalid_idx_value()
        ctx_indices = torch.where(invalid_mask, invalid_idx_value, ctx_indices)
        k_out = ctx_gather(k_out, ctx_indices, ctx_len)
        v_out = ctx_gather(v_out, ctx_indices, ctx_len)
        v_out = torch.where(invalid_mask.unsqueeze(-1), torch.zeros_like(v_out), v_out)
        return k_out, v_out


class QEffGemma4DynamicLayer(QEffDynamicLayer):
    def __init__(self, is_sliding: bool = False):
        super().__init__()
        self.is_sliding = is_sliding

    @classmethod
    def from_tensors(cls, key_states, value_states, is_sliding=False):
        layer = cls(is_sliding=is_sliding)
        layer.keys = key_states
        layer.values = value_states
        return layer

    def update(self, key_states, value_states, cache_kwargs=None):
        if not self.is_sliding or cache_kwargs is None:
            return super().update(key_states, value_states, cache_kwargs)

        if self.keys is None:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values

        position_ids = cache_kwargs.get("position_ids")
        layer_ctx_len = self.keys.shape[2]

        kv_position_ids = torch.where(
            position_ids == -1, position_ids, _remainder_with_symbolic_divisor(position_ids, layer_ctx_len)
        )
        if not FIXED:
            kv_position_ids = torch.where(
                position_ids.max() >= (layer_ctx_len - 1) * 2,
                _remainder_with_symbolic_divisor(position_ids + 1, layer_ctx_len),
                kv_position_ids,
            )

        valid_mask = (kv_position_ids != -1).unsqueeze(1).unsqueeze(-1)
        key_states = torch.where(valid_mask, key_states, torch.zeros_like(key_states))
        value_states = torch.where(valid_mask, value_states, torch.zeros_like(value_states))

        self.keys = ctx_scatter(self.keys, kv_position_ids, key_states)
        self.values = ctx_scatter(self.values, kv_position_ids, value_states)

        k_out, v_out = self.keys, self.values

        ctx_len = cache_kwargs.get("CCL", k_out.shape[2])
        ctx_len = min(layer_ctx_len, ctx_len)
        if FIXED:
            ctx_indices = torch.arange(ctx_len, dtype=position_ids.dtype)[None, None, ...]
            gather_limit = position_ids.max(1, keepdim=True).values.unsqueeze(1).to(position_ids.dtype)
            invalid_mask = ctx_indices > gather_limit
            invalid_idx_value = InvalidIndexProvider._get_invalid_idx_value()
            ctx_indices = torch.where(invalid_mask, invalid_idx_value, ctx_indices)
            k_out = ctx_gather(k_out, ctx_indices, ctx_len)
            v_out = ctx_gather(v_out, ctx_indices, ctx_len)
            v_out = torch.where(invalid_mask.unsqueeze(-1), torch.zeros_like(v_out), v_out)
            return k_out, v_out

        ctx_indices = torch.arange(ctx_len, dtype=kv_position_ids.dtype)[None, None, ...]
        gather_limit = kv_position_ids.max(1, keepdim=True).values.unsqueeze(1).to(position_ids.dtype)
        invalid_mask = ctx_indices > gather_limit
        invalid_idx_value = InvalidIndexProvider._get_invalid_idx_value()
        ctx_indices = torch.where(invalid_mask, invalid_idx_value, ctx_indices)

        all_indices = torch.arange(layer_ctx_len) + kv_position_ids.max() + 1
        rolling_indices = torch.where(
            all_indices > layer_ctx_len - 1, _remainder_with_symbolic_divisor(all_indices, layer_ctx_len), all_indices
        )
        rolling_indices = rolling_indices[:ctx_len]
        use_rolling_indices = position_ids.max() >= (layer_ctx_len - 1)
        final_indices = torch.where(use_rolling_indices, rolling_indices, ctx_indices)

        k_out = ctx_gather(k_out, final_indices, ctx_len)
        v_out = ctx_gather(v_out, final_indices, ctx_len)

        k_ctx_out = torch.where(invalid_mask.unsqueeze(-1), torch.zeros_like(k_out), k_out)
        v_ctx_out = torch.where(invalid_mask.unsqueeze(-1), torch.zeros_like(v_out), v_out)
        k_out = torch.where(use_rolling_indices, k_out, k_ctx_out)
        v_out = torch.where(use_rolling_indices, v_out, v_ctx_out)
        return k_out, v_out


class QEffGemma4DynamicCache:
    def __init__(self, config=None):
        self.config = config
        self.layers = []

    def _is_sliding_layer(self, layer_idx):
        layer_types = getattr(self.config, "layer_types", None)
        return (
            layer_types is not None and layer_idx < len(layer_types)
            and layer_types[layer_idx] == "sliding_attention"
        )

    def append_new_layers(self, layer_idx):
        while len(self.layers) <= layer_idx:
            self.layers.append(QEffGemma4DynamicLayer(is_sliding=self._is_sliding_layer(len(self.layers))))

    @classmethod
    def from_legacy_cache(cls, config, past_key_values=None):
        cache = cls(config=config)
        if past_key_values is not None:
            for layer_idx, (key_states, value_states) in enumerate(past_key_values):
                cache.append_new_layers(layer_idx)
                cache.layers[layer_idx] = QEffGemma4DynamicLayer.from_tensors(
                    key_states, value_states, is_sliding=cache._is_sliding_layer(layer_idx)
                )
        return cache

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    def to_legacy_cache(self):
        return tuple((layer.keys, layer.values) for layer in self.layers)


# ---- QEfficient/transformers/modeling_attn_mask_utils.py --------------------------------------
def _create_causal_mask(position_ids, target_length, sliding_window: Optional[int] = None, start_index=0):
    if sliding_window is not None:
        query_indices = position_ids.unsqueeze(-1)
        kv_indices = torch.arange(target_length).view(1, -1)
        # --- Rolling buffer ---
        pos_max = position_ids.max(1, keepdim=True).values
        kv_start = torch.div(pos_max, target_length, rounding_mode="floor") * target_length
        kv_indices_high = kv_indices + kv_start
        kv_indices_low = torch.where(kv_indices_high < target_length, kv_indices, kv_indices_high - target_length)
        kv_indices = torch.where(kv_indices_high > pos_max, kv_indices_low, kv_indices_high)
        kv_indices = kv_indices.unsqueeze(1)
        # ------
        causal_mask = kv_indices > query_indices
        attention_mask = causal_mask

        window_indices = query_indices - sliding_window + 1
        window_mask = kv_indices < window_indices
        attention_mask = attention_mask | window_mask
        attention_mask = attention_mask.unsqueeze(1)
    else:
        query_indices = position_ids.unsqueeze(-1)
        kv_indices = torch.arange(start=start_index, end=target_length).view(1, 1, -1)
        attention_mask = kv_indices > query_indices
        attention_mask = attention_mask.unsqueeze(1)
    return attention_mask


# ---- QEfficient/transformers/models/gemma4/modeling_gemma4.py (text path, trimmed) -------------
def _build_additive_attention_mask(position_ids, target_length, dtype, sliding_window=None):
    return _create_causal_mask(position_ids=position_ids, target_length=target_length,
                               sliding_window=sliding_window)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2):
    return x * cos.unsqueeze(unsqueeze_dim) + rotate_half(x) * sin.unsqueeze(unsqueeze_dim)


def eager_attention_forward_text(module, query, key, value, attention_mask, scaling=None, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = torch.where(
            attention_mask, torch.tensor(MIN_MASKED_ATTENTION_VALUE, dtype=attn_weights.dtype), attn_weights
        )
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = {t: p["rope_theta"] for t, p in config.rope_parameters.items()}

    def forward(self, x, position_ids, layer_type):
        inv_freq = 1.0 / (self.theta[layer_type] ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = position_ids.clamp(min=0).float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class QEffGemma4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = 1.0
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                position_ids=None, batch_index=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cache_kwargs = {"position_ids": position_ids, "batch_index": batch_index}
        cos, sin = position_embeddings

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        query_states = apply_rotary_pos_emb(query_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
        key_states = apply_rotary_pos_emb(key_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(
                key_states, value_states, self.layer_idx, cache_kwargs
            )

        attn_output, attn_weights = eager_attention_forward_text(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class QEffGemma4TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = QEffGemma4TextAttention(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size, bias=False), nn.GELU(approximate="tanh"),
            nn.Linear(config.intermediate_size, config.hidden_size, bias=False),
        )

    def forward(self, hidden_states, position_embeddings, attention_mask, position_ids, past_key_values):
        residual = hidden_states
        h, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                              past_key_values=past_key_values, position_ids=position_ids)
        hidden_states = residual + self.post_attention_layernorm(h)
        return hidden_states + self.mlp(self.pre_feedforward_layernorm(hidden_states))


class QEffGemma4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QEffGemma4TextDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.unique_layer_types = sorted(set(config.layer_types))

    def forward(self, input_ids, position_ids, past_key_values):
        past_key_values = QEffGemma4DynamicCache.from_legacy_cache(self.config, past_key_values)
        inputs_embeds = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5
        hidden_states = inputs_embeds
        position_embeddings = {}
        for layer_type in self.unique_layer_types:
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            layer_type = self.config.layer_types[i]
            sliding_window = self.config.sliding_window if layer_type == "sliding_attention" else None
            target_length = (
                min(self.config.sliding_window, self.config.max_position_embeddings)
                if sliding_window
                else inputs_embeds.shape[1]
            )
            if past_key_values is not None and len(past_key_values.layers) > i:
                layer_keys = past_key_values.layers[i].keys
                if layer_keys is not None and layer_keys.numel() > 0:
                    target_length = layer_keys.shape[-2]
            layer_attention_mask = _build_additive_attention_mask(
                position_ids=position_ids, target_length=target_length,
                dtype=hidden_states.dtype, sliding_window=sliding_window,
            )
            hidden_states = decoder_layer(hidden_states, position_embeddings[layer_type],
                                          layer_attention_mask, position_ids, past_key_values)

        hidden_states = self.norm(hidden_states)
        # QEff keeps only the last valid position's logits
        logit_index = position_ids.to(torch.int32).argmax(1, keepdim=True)
        hidden_states = hidden_states[torch.arange(position_ids.shape[0]).view(-1, 1), logit_index]
        logits = F.linear(hidden_states, self.embed_tokens.weight)
        return logits, past_key_values.to_legacy_cache()


def main():
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32,
    )
    config.allow_global_per_layer_attribute_access = True  # QEff reads config.head_dim globally
    model = QEffGemma4ForCausalLM(config).eval()
    ctx_len = 16
    past_key_values = []
    for layer_type in config.layer_types:
        layer_len = config.sliding_window if layer_type == "sliding_attention" else ctx_len
        shape = (1, config.num_key_value_heads, layer_len, config.head_dim)
        past_key_values.append((torch.zeros(shape), torch.zeros(shape)))
    past_key_values = tuple(past_key_values)

    prompt = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        position_ids = torch.arange(prompt.shape[1]).view(1, -1)
        logits, past_key_values = model(prompt, position_ids, past_key_values)
        generated, step_logits = [], []
        next_pos = prompt.shape[1]
        for _ in range(8):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(nxt))
            logits, past_key_values = model(nxt, torch.tensor([[next_pos]]), past_key_values)
            step_logits.append(logits[0, -1, :4])
            next_pos += 1
    print("generated:", generated)
    for pos, lg in zip(range(prompt.shape[1], next_pos), step_logits):
        print(f"position {pos} logits[:4]:", [round(x, 4) for x in lg.tolist()])


if __name__ == "__main__":
    main()
