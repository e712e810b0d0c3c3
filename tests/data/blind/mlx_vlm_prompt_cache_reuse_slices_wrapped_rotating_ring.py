"""mlx-vlm multi-turn prompt-cache reuse cut a wrapped sliding-window ring buffer by a logical length.

Citation: Blaizzy/mlx-vlm#1748 (commit c503fa7b, "Fix prompt-cache prefix reuse corrupting rotating
KV caches"), fixes Blaizzy/mlx-vlm#1715; mlx_vlm/generate/dispatch.py (stream_generate,
PromptCacheState), mlx_vlm/models/cache.py (KVCache, RotatingKVCache), mlx_vlm/models/gemma3/language.py.

The bug: ``stream_generate`` keeps the previous turn's KV cache in a ``PromptCacheState`` and, on the
next turn, reuses the common token prefix. It cut every cache back to ``prefix_len`` with a raw slice,
``c.keys = c.keys[:, :, :prefix_len, :]`` and ``c.offset = prefix_len``. That is right for a flat
``KVCache``; on a Gemma-3 sliding layer's ``RotatingKVCache`` whose ring has wrapped during the previous
turn's generation, the first ``prefix_len`` slots hold the latest generated tokens (in ring order, with
their RoPE positions), not the prompt's first ``prefix_len`` tokens, and ``_idx`` is left stale. The
sliding layers then prefill the new turn against the wrong keys at the wrong positions: no error, the
reply differs from a cold run of the same prompt.

The fix: ``_prefix_cache_trim_amount`` reuses the prefix only when every cache still holds its whole
sequence from position 0 (a rotating cache whose ``offset <= max_size``), trimming each cache through its
own ``trim()``; a wrapped ring returns ``None`` and the turn is prefilled cold.

A torch port of the MLX code at toy sizes with random weights: Gemma-3's text decoder (sliding layers on
``RotatingKVCache(max_size=sliding_window)``, a global layer on ``KVCache``, ``create_attention_mask`` /
``make_mask`` / ``create_causal_mask``), ``generate_step``'s prefill + greedy decode loop, and
``stream_generate``'s per-turn reuse. ``mx.fast.scaled_dot_product_attention`` is rendered with MLX's
mask semantics (``"causal"`` is bottom-right causal, a bool array keeps True) on torch's SDPA.
"""

import sys
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- mlx_vlm/models/cache.py


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def _cache_create_attention_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    elif N == 1:
        return None
    elif return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    else:
        return "causal"


class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return _cache_create_attention_mask(*args, offset=self.offset, **kwargs)


class RotatingKVCache:
    step = 256

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
                [
                    v[..., : self.keep, :],
                    v[..., self._idx :, :],
                    v[..., self.keep : self._idx, :],
                ],
                dim=2,
            )
        else:
            return v[..., : self._idx, :]

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys = keys
            self.values = values
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
            new_size = min(self.step, self.max_size - prev)
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

    def is_trimmable(self):
        return self.offset < self.max_size

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
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
                if self.offset < self.max_size:
                    mask_size = self.offset + 1
                else:
                    mask_size = self.max_size
                mask = torch.arange(mask_size) >= (mask_size - window_size)
                mask = torch.roll(mask, shifts=idx + 1)
                return mask


def make_prompt_cache(model, max_kv_size: Optional[int] = None) -> List[Any]:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in range(len(model.layers))]


# ---------------------------------------------------------------- mlx_vlm/models/base.py


def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def mx_fast_sdpa(queries, keys, values, scale, mask):
    # mx.fast.scaled_dot_product_attention: GQA by head groups, "causal" = bottom-right causal,
    # a bool mask keeps True.
    L, S = queries.shape[2], keys.shape[2]
    rep = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1)
    values = values.repeat_interleave(rep, dim=1)
    if isinstance(mask, str) and mask == "causal":
        mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    return mx_fast_sdpa(queries, keys, values, scale=scale, mask=mask)


# ---------------------------------------------------------------- mlx_vlm/models/gemma3/language.py


@dataclass
class TextConfig:
    model_type: str = "gemma3_text"
    hidden_size: int = 48
    num_hidden_layers: int = 4
    intermediate_size: int = 96
    num_attention_heads: int = 4
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    vocab_size: int = 96
    num_key_value_heads: int = 2
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_traditional: bool = False
    query_pre_attn_scalar: float = 16.0
    sliding_window: int = 8
    sliding_window_pattern: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight)).to(x.dtype)


class RoPE(nn.Module):
    # nn.RoPE(dims, traditional=False, base): rotates the two halves of the head dim.
    def __init__(self, dims: int, traditional: bool = False, base: float = 10000.0):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset: int = 0):
        L = x.shape[-2]
        half = self.dims // 2
        inv = self.base ** (-torch.arange(0, half, dtype=torch.float32) / half)
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        theta = pos[:, None] * inv[None]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = n_heads = config.num_attention_heads
        self.n_kv_heads = n_kv_heads = config.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = config.head_dim
        self.layer_idx = layer_idx
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(dims=head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(dims=head_dim, eps=config.rms_norm_eps)
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
            key_len = keys.shape[2]
            if mask.shape[-1] != key_len:
                mask = mask[..., -key_len:]

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
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = self.post_attention_layernorm(r)
        h = x + h
        r = self.mlp(self.pre_feedforward_layernorm(h))
        out = self.post_feedforward_layernorm(r)
        return h + out


class Gemma3Model(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.window_size = config.sliding_window
        self.sliding_window_pattern = config.sliding_window_pattern
        self.num_hidden_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [TransformerBlock(config=config, layer_idx=i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None):
        if inputs_embeds is None:
            h = self.embed_tokens(inputs)
        else:
            h = inputs_embeds
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=torch.bfloat16).to(h.dtype)

        if cache is None:
            cache = [None] * len(self.layers)

        if mask is None:
            global_mask = create_attention_mask(h, cache[self.sliding_window_pattern - 1])
            if self.sliding_window_pattern > 1:
                sliding_window_mask = create_attention_mask(h, cache[0], window_size=self.window_size)
            else:
                sliding_window_mask = None

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
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None, **kwargs):
        out = self.model(inputs, inputs_embeds=inputs_embeds, mask=mask, cache=cache)
        return self.lm_head(out)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        caches = []
        for i in range(self.config.num_hidden_layers):
            if i % self.config.sliding_window_pattern == self.config.sliding_window_pattern - 1:
                caches.append(KVCache())
            else:
                caches.append(RotatingKVCache(max_size=self.config.sliding_window, keep=0))
        return caches


# ---------------------------------------------------------------- mlx_vlm/generate/ar.py


@torch.no_grad()
def generate_step(input_ids, model, prompt_cache, max_tokens: int = 256):
    def _step(y):
        logits = model(y, cache=prompt_cache)[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = torch.argmax(logprobs, dim=-1)
        return y, logprobs.squeeze(0)

    y, logprobs = _step(input_ids)

    n = 0
    while True:
        if n != max_tokens:
            next_y, next_logprobs = _step(y[None])
        if n == max_tokens:
            break
        yield y.item(), logprobs
        y, logprobs = next_y, next_logprobs
        n += 1


# ---------------------------------------------------------------- mlx_vlm/generate/dispatch.py


class PromptCacheState:
    """Holds KV cache and token history across conversation turns."""

    def __init__(self):
        self.cache: Optional[List[Any]] = None
        self.token_ids: Optional[List[int]] = None

    def find_prefix_length(self, new_ids: list) -> int:
        if self.token_ids is None:
            return 0
        max_len = min(len(self.token_ids), len(new_ids))
        for i in range(max_len):
            if self.token_ids[i] != new_ids[i]:
                return i
        return max_len

    def update(self, token_ids: list, kv_cache: list):
        self.token_ids = list(token_ids)
        self.cache = kv_cache


def _cache_fully_retained(c: Any) -> bool:
    children = getattr(c, "caches", None)
    if children is not None:  # CacheList
        return all(_cache_fully_retained(x) for x in children)
    start_position = getattr(c, "start_position", None)
    if start_position is not None:  # Buffered/Chunked: evicts by advancing start
        return int(start_position) == 0
    max_size = getattr(c, "max_size", None)
    if max_size is not None:  # RotatingKVCache: reusable until the window wraps
        return int(getattr(c, "offset", 0) or 0) <= int(max_size)
    return True  # KVCache / QuantizedKVCache retain the whole sequence


def _prefix_cache_trim_amount(kv_cache: List[Any], prefix_len: int) -> Optional[int]:
    cached_len = max((int(getattr(c, "offset", 0) or 0) for c in kv_cache), default=0)
    n_drop = max(0, cached_len - prefix_len)
    if n_drop and not all(_cache_fully_retained(c) for c in kv_cache):
        return None
    return n_drop


def stream_generate(model, prompt_ids: List[int], eos_token_id: int, max_tokens: int, **kwargs):
    prompt_cache_state = kwargs.pop("prompt_cache_state", None)
    input_ids = torch.tensor([prompt_ids])
    full_input_ids_list = list(prompt_ids)
    reused_prefix_len = 0

    def _apc_suffix_is_text_only(prefix_len: int) -> bool:
        return True  # text-only conversation: no image tokens after the prefix

    if prompt_cache_state is not None and prompt_cache_state.cache is not None:
        prefix_len = prompt_cache_state.find_prefix_length(full_input_ids_list)
        if not FIXED:
            if prefix_len > 0 and prefix_len < input_ids.shape[1]:
                if _apc_suffix_is_text_only(prefix_len):
                    reused_prefix_len = prefix_len
                    # Trim to only new tokens
                    input_ids = input_ids[:, prefix_len:]
                    # Reuse the saved KV cache (trimmed to prefix length)
                    kv_cache = prompt_cache_state.cache
                    # Trim cache to prefix_len in case it includes generated tokens
                    for c in kv_cache:
                        if hasattr(c, "keys") and c.keys is not None:
                            cached_len = c.keys.shape[2]
                            if cached_len > prefix_len:
                                c.keys = c.keys[:, :, :prefix_len, :]
                                c.values = c.values[:, :, :prefix_len, :]
                                if hasattr(c, "offset"):
                                    c.offset = prefix_len
                    kwargs["prompt_cache"] = kv_cache
        else:
            kv_cache = prompt_cache_state.cache
            n_drop = _prefix_cache_trim_amount(kv_cache, prefix_len)
            if 0 < prefix_len < input_ids.shape[1] and n_drop is not None and _apc_suffix_is_text_only(prefix_len):
                for c in kv_cache:
                    if n_drop:
                        c.trim(n_drop)
                reused_prefix_len = prefix_len
                input_ids = input_ids[:, prefix_len:]
                kwargs["prompt_cache"] = kv_cache

    if "prompt_cache" not in kwargs:
        kwargs["prompt_cache"] = make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size", None))
    tracked_cache = kwargs["prompt_cache"]

    generated_tokens = []
    for n, (token, logprobs) in enumerate(
        generate_step(input_ids, model, tracked_cache, max_tokens=max_tokens)
    ):
        generated_tokens.append(token)
        if token == eos_token_id:
            break

    if prompt_cache_state is not None:
        all_ids = full_input_ids_list + generated_tokens
        prompt_cache_state.update(all_ids, tracked_cache)
    return generated_tokens, reused_prefix_len


# ---------------------------------------------------------------- a two-turn chat


def main():
    torch.manual_seed(0)
    config = TextConfig()
    model = LanguageModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.35)

    EOS = config.vocab_size - 1
    state = PromptCacheState()

    # Turn 1: a 6-token prompt; 10 generated tokens wrap the sliding layers' 8-slot rings.
    turn1 = [2, 17, 33, 5, 41, 60]
    reply1, _ = stream_generate(model, turn1, EOS, max_tokens=10, prompt_cache_state=state)
    print("turn 1 reply:", reply1)
    print("cache offsets after turn 1:", [c.offset for c in state.cache])

    # Turn 2: the user edits the question: the first 5 tokens are shared, the rest is new.
    turn2 = [2, 17, 33, 5, 41, 12, 70, 9, 28]
    reply2, reused = stream_generate(model, turn2, EOS, max_tokens=8, prompt_cache_state=state)
    print("turn 2 reused prefix:", reused)
    print("turn 2 reply:", reply2)


if __name__ == "__main__":
    main()
