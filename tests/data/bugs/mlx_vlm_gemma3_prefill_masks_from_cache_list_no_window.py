# Blaizzy/mlx-vlm commit be852ea6 (#681, "Add text prefill and input embeddings obj"; the Gemma 3 part first
# proposed in #669, "fix(gemma3): correct attention mask creation for sliding window"), mlx_vlm/models/gemma3/
# language.py, Gemma3Model.__call__. MLX ported to torch at tiny sizes; mlx-lm's create_attention_mask,
# create_causal_mask, KVCache / RotatingKVCache (make_mask, update_and_fetch) and mx.fast's "causal" string mask
# ported with it.
#
# Before the fix the model built its two masks from list slices of the per-layer caches:
#     full_mask = create_attention_mask(h, cache[j - 1 : j]); sliding_window_mask = create_attention_mask(h, cache)
# A list has no make_mask(), so both came back as the plain "causal" mask and no window_size was passed: on a
# prompt longer than config.sliding_window the local layers (whose RotatingKVCache returns every prompt key on
# the first prefill) attended the whole causal prefix. The fix passes one cache object to each call and
# window_size=config.sliding_window for the sliding layers' mask.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------- mlx-lm base / cache (ported)
def create_causal_mask(N, offset=0, window_size=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def _cache_attention_mask(N, offset, return_array, window_size):
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, offset, window_size=window_size)
    return "causal"


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return _cache_attention_mask(N, self.offset, return_array, window_size)


class RotatingKVCache:
    def __init__(self, max_size, keep=0):
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    def _trim(self, trim_size, v, append=None):
        to_cat = []
        if trim_size > 0:
            to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
        else:
            to_cat = [v]
        if append is not None:
            to_cat.append(append)
        return torch.cat(to_cat, dim=2)

    def _temporal_order(self, v):
        if self._idx == v.shape[2]:
            return v
        elif self._idx < self.offset:
            return torch.cat(
                [v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]], dim=2
            )
        else:
            return v[..., : self._idx, :]

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = self.keys.shape[2]
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            v_head_dim = values.shape[3]
            new_size = min(256, self.max_size - prev)
            k_shape = (B, n_kv_heads, new_size, k_head_dim)
            v_shape = (B, n_kv_heads, new_size, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev

        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size

        if self._idx == self.max_size:
            self._idx = self.keep

        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self.offset += S
        self._idx += S

        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def make_mask(self, N, window_size=None, return_array=False):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            else:
                return "causal"
        else:
            if window_size is None:
                return None
            if self.offset >= window_size and self.max_size > window_size:
                idx = self._idx
                if idx >= self.max_size:
                    idx = 0
                mask_size = self.offset + 1 if self.offset < self.max_size else self.max_size
                mask = torch.arange(mask_size) >= (mask_size - window_size)
                mask = torch.roll(mask, shifts=idx + 1)
                return mask
            return None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    # mx.fast.scaled_dot_product_attention: "causal" is aligned to the bottom right, a bool array keeps True
    L, S = queries.shape[-2], keys.shape[-2]
    repeats = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(repeats, dim=1)
    values = values.repeat_interleave(repeats, dim=1)
    scores = (queries * scale) @ keys.transpose(-1, -2)
    if isinstance(mask, str) and mask == "causal":
        qi = torch.arange(S - L, S)[:, None]
        ki = torch.arange(S)[None]
        scores = scores.masked_fill(~(qi >= ki), float("-inf"))
    elif mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values


# ----------------------------------------------------------------------------- mlx_vlm/models/gemma3 (ported)
@dataclass
class TextConfig:
    model_type: str = "gemma3_text"
    hidden_size: int = 64
    num_hidden_layers: int = 6
    intermediate_size: int = 128
    num_attention_heads: int = 4
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    vocab_size: int = 97
    num_key_value_heads: int = 2
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_traditional: bool = False
    query_pre_attn_scalar: float = 16
    sliding_window: int = 4
    sliding_window_pattern: int = 3


class RMSNorm(nn.Module):
    def __init__(self, dims, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dims) * 0.1)
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * (1.0 + self.weight)


class RoPE(nn.Module):
    # mlx.nn.RoPE(dims, traditional=False, base): rotates the two halves, positions start at `offset`
    def __init__(self, dims, traditional=False, base=10000.0):
        super().__init__()
        self.dims, self.base = dims, base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        half = self.dims // 2
        inv = self.base ** (-torch.arange(half, dtype=torch.float32) / half)
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        theta = pos[:, None] * inv[None]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = n_heads = config.num_attention_heads
        self.n_kv_heads = n_kv_heads = config.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = config.head_dim
        self.layer_idx = layer_idx
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.is_sliding = (layer_idx + 1) % config.sliding_window_pattern != 0
        self.rope = RoPE(
            head_dim,
            traditional=config.rope_traditional,
            base=(config.rope_local_base_freq if self.is_sliding else config.rope_global_base_freq),
        )

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        queries = self.q_norm(queries)
        keys = self.k_norm(keys)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        # Sliding window
        if mask is not None and isinstance(mask, torch.Tensor):
            if mask.shape[-1] != keys.shape[-2]:
                mask = mask[..., -keys.shape[-2]:]

        output = scaled_dot_product_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r)


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.window_size = config.sliding_window
        self.sliding_window_pattern = config.sliding_window_pattern
        self.num_hidden_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.bfloat16).to(h.dtype)

        if cache is None:
            cache = [None] * len(self.layers)

        if mask is None:
            if FIXED:
                global_mask = create_attention_mask(h, cache[self.sliding_window_pattern - 1])
                if self.sliding_window_pattern > 1:
                    sliding_window_mask = create_attention_mask(h, cache[0], window_size=self.window_size)
                else:
                    sliding_window_mask = None
            else:
                j = self.config.sliding_window_pattern
                global_mask = create_attention_mask(h, cache[j - 1 : j])
                sliding_window_mask = create_attention_mask(h, cache)

        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            is_global = i % self.sliding_window_pattern == self.sliding_window_pattern - 1
            local_mask = mask
            if mask is None and is_global:
                local_mask = global_mask
            elif mask is None:
                local_mask = sliding_window_mask
            h = layer(h, local_mask, c)

        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None):
        out = self.model(inputs, inputs_embeds=inputs_embeds, mask=mask, cache=cache)
        return self.lm_head(out)

    def make_cache(self):
        caches = []
        for i in range(self.config.num_hidden_layers):
            if i % self.config.sliding_window_pattern == self.config.sliding_window_pattern - 1:
                caches.append(KVCache())
            else:
                caches.append(RotatingKVCache(max_size=self.config.sliding_window, keep=0))
        return caches


# ----------------------------------------------------------------------------- generate_step (greedy, trimmed)
def generate(model, prompt, max_tokens):
    cache = model.make_cache()
    logits = model(prompt[None], cache=cache)[:, -1, :]
    first_logits = logits.clone()
    y = logits.argmax(-1)
    out = [y.item()]
    for _ in range(max_tokens - 1):
        logits = model(y[:, None], cache=cache)[:, -1, :]
        y = logits.argmax(-1)
        out.append(y.item())
    return out, first_logits


def main():
    config = TextConfig()
    model = LanguageModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
        prompt = torch.randint(0, config.vocab_size, (12,))  # longer than sliding_window=4
        tokens, first_logits = generate(model, prompt, max_tokens=8)
    print("mode:", "fixed" if FIXED else "buggy")
    print("prompt:", prompt.tolist())
    print("generated:", tokens)
    print("first-step logits[:6]:", [round(v, 4) for v in first_logits[0, :6].tolist()])


if __name__ == "__main__":
    main()
