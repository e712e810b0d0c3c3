# mlx-lm (ml-explore/mlx-lm#1806, fixed by ml-explore/mlx-lm#1848, "Rebind BatchKVCache offset instead of mutating
# in place"; same bug reported from the model side as ml-explore/mlx-lm#1699): BatchKVCache keeps its per-row
# `offset` as an array and advances it in place (`self.offset += keys.shape[2]`). Gemma3nAttention binds
# `offset = cache.offset`, RoPEs the keys, calls `cache.update_and_fetch`, and only then RoPEs the queries with the
# same `offset`, so under batched generation (BatchGenerator / mlx_lm.server) the queries are rotated at the
# post-update offset (position + L) while the keys sit at their true positions. The fix rebinds the attribute
# (`self.offset = self.offset + ...`) at every offset-touching site so a captured handle keeps the pre-update value.
# Ported from MLX to torch: mlx_lm/models/cache.py BatchKVCache, mlx_lm/models/base.py create_causal_mask /
# create_attention_mask, mlx_lm/models/gemma3n.py Gemma3nAttention / LanguageModel, mlx_lm/generate.py _make_cache /
# _left_pad_prompts. Trimmed: the tiny config has only full-attention layers and no KV-shared layers (so no
# BatchRotatingKVCache), and the decoder layer drops AltUp / Laurel / per-layer inputs; the attention is written as
# mx.fast.scaled_dot_product_attention computes it (boolean mask, scale 1.0, grouped KV heads).
import sys
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- mlx_lm/models/base.py
@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params):
        return cls(**{k: v for k, v in params.items() if k in inspect.signature(cls).parameters})


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    right_padding: Optional[torch.Tensor] = None,
    left_padding: Optional[torch.Tensor] = None,
):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if right_padding is not None:
        mask = mask & (rinds < ((offset + N) - right_padding)[:, None, None, None])
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= rinds)
    return mask


def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def fast_scaled_dot_product_attention(queries, keys, values, scale, mask):
    # mx.fast.scaled_dot_product_attention: grouped KV heads, boolean mask keeps True
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.shape[1]
    n_repeats = n_q_heads // n_kv_heads
    if n_repeats > 1:
        keys = keys.repeat_interleave(n_repeats, dim=1)
        values = values.repeat_interleave(n_repeats, dim=1)
    scores = (queries * scale) @ keys.transpose(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            q_indices = torch.arange(kL - qL, kL)
            k_indices = torch.arange(kL)
            mask = q_indices[:, None] >= k_indices[None]
        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    scores = torch.softmax(scores, dim=-1)
    return scores @ values


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    return fast_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


# ---- mlx.nn.RoPE (traditional=False), offset may be a per-row array
class RoPE(nn.Module):
    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base
        self.scale = scale

    def forward(self, x, offset=0):
        B, H, L, D = x.shape
        inv_freq = self.base ** (-torch.arange(0, self.dims, 2, dtype=torch.float32) / self.dims)
        if isinstance(offset, torch.Tensor):
            positions = offset.reshape(-1, 1).float() + torch.arange(L, dtype=torch.float32)[None]
            positions = positions[:, None, :]  # (B, 1, L)
        else:
            positions = (offset + torch.arange(L, dtype=torch.float32))[None, None, :]
        theta = (positions * self.scale)[..., None] * inv_freq  # (B|1, 1, L, D/2)
        cos, sin = torch.cos(theta), torch.sin(theta)
        x1, x2 = x[..., : self.dims // 2], x[..., self.dims // 2 : self.dims]
        rx1 = x1 * cos - x2 * sin
        rx2 = x1 * sin + x2 * cos
        return torch.cat([rx1, rx2, x[..., self.dims :]], dim=-1)


# ---- mlx_lm/models/cache.py
class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: List[int]):
        """
        The BatchKV cache expects inputs to be left-padded.
        ``left_padding`` specifies the amount of padding for each row.
        """
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._idx = 0

        self._right_padding = None

    def update_and_fetch(self, keys, values):
        prev = self._idx
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

        if FIXED:
            self.offset = self.offset + keys.shape[2]
        else:
            self.offset += keys.shape[2]
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchKVCache")
            left_padding = torch.tensor(left_padding)
            if FIXED:
                self.left_padding = self.left_padding + left_padding
                self.offset = self.offset - left_padding
            else:
                self.left_padding += left_padding
                self.offset -= left_padding

        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = torch.tensor(right_padding)

    @property
    def state(self):
        k, v = self.keys, self.values
        if self._idx < k.shape[2]:
            k = k[..., : self._idx, :]
            v = v[..., : self._idx, :]
        return k, v, self.offset, self.left_padding

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self._idx, n)
        self._idx -= n
        if FIXED:
            self.offset = self.offset - n
        else:
            self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)


# ---- mlx_lm/models/gemma3n.py (text model, trimmed)
@dataclass
class TextConfig(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    num_kv_shared_layers: int
    sliding_window: int
    max_position_embeddings: int
    rope_local_base_freq: float
    rope_theta: float
    final_logit_softcapping: float
    layer_types: List[str]
    rope_scaling: Optional[Dict] = None


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RMSNoScale(nn.Module):
    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Gemma3nAttention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int, is_kv_shared_layer: bool):
        super().__init__()
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"

        dim = config.hidden_size
        self.n_heads = n_heads = config.num_attention_heads
        self.n_kv_heads = n_kv_heads = config.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = config.head_dim
        self.layer_idx = layer_idx

        self.scale = 1.0

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

        self.q_norm = RMSNorm(dims=config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(dims=config.head_dim, eps=config.rms_norm_eps)
        self.v_norm = RMSNoScale(eps=config.rms_norm_eps)

        self.is_kv_shared_layer = is_kv_shared_layer

        self.rope = RoPE(
            head_dim,
            traditional=False,
            base=(config.rope_local_base_freq if self.is_sliding else config.rope_theta),
        )

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        B, L, _ = x.shape

        queries = self.q_proj(x)
        queries = queries.reshape(B, L, -1, self.head_dim)
        queries = self.q_norm(queries)

        offset = 0
        if self.is_kv_shared_layer and cache is not None:
            # For shared layers, retrieve KV from the designated cache layer
            keys, values = cache.state
            offset = cache.offset

        else:
            if cache is not None:
                offset = cache.offset
            keys = self.k_proj(x).reshape(B, L, -1, self.head_dim)
            keys = self.k_norm(keys)
            keys = keys.transpose(1, 2)
            keys = self.rope(keys, offset=offset)

            values = self.v_proj(x).reshape(B, L, -1, self.head_dim)
            values = self.v_norm(values)
            values = values.transpose(1, 2)

            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)

        queries = queries.transpose(1, 2)
        queries = self.rope(queries, offset=offset)

        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

        output = output.transpose(1, 2).reshape(B, L, -1)

        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int = 0):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int, is_kv_shared_layer: bool):
        super().__init__()
        self.self_attn = Gemma3nAttention(config, layer_idx, is_kv_shared_layer)
        self.mlp = MLP(config, layer_idx=layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.is_sliding = self.self_attn.is_sliding

    def forward(self, x, mask=None, cache=None):
        attn = self.self_attn(self.input_layernorm(x), mask, cache)
        attn = self.post_attention_layernorm(attn)
        h = x + attn
        ffw = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h + ffw


def logit_softcap(softcap, x):
    out = torch.tanh(x / softcap)
    out = out * softcap
    return out


class LanguageModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.final_logit_softcapping = config.final_logit_softcapping
        self.first_kv_shared_layer_idx = config.num_hidden_layers - config.num_kv_shared_layers

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                Gemma3nDecoderLayer(
                    config=config,
                    layer_idx=layer_idx,
                    is_kv_shared_layer=layer_idx >= self.first_kv_shared_layer_idx,
                )
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        self.first_full_idx = config.layer_types.index("full_attention")
        self.sliding_window = config.sliding_window
        self.layer_idx_to_cache_idx = list(range(config.num_hidden_layers))

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs) * (self.hidden_size**0.5)

        if cache is None:
            cache = [None] * len(self.layers)

        global_mask = create_attention_mask(h, cache[self.first_full_idx])

        for i, layer in enumerate(self.layers):
            mask = global_mask
            h = layer(h, mask, cache[self.layer_idx_to_cache_idx[i]])

        out = self.norm(h)
        out = out @ self.embed_tokens.weight.T
        if self.final_logit_softcapping is not None:
            out = logit_softcap(self.final_logit_softcapping, out)
        return out

    def make_cache(self):
        caches = []
        for layer_type in self.config.layer_types[: self.first_kv_shared_layer_idx]:
            if layer_type == "full_attention":
                caches.append(KVCache())
            else:
                raise NotImplementedError(f"Unknown layer type: {layer_type}")
        return caches


# ---- mlx_lm/generate.py (batched path)
def _left_pad_prompts(prompts, max_length=None):
    if max_length is None:
        max_length = max(len(p) for p in prompts)
    return torch.tensor([[0] * (max_length - len(p)) + p for p in prompts])


def _make_cache(model, left_padding, max_kv_size):
    def to_batch_cache(c):
        if type(c) is KVCache:
            return BatchKVCache(left_padding)
        raise ValueError(f"{type(c)} does not yet support batching")

    cache = model.make_cache()
    return [to_batch_cache(c) for c in cache]


@torch.no_grad()
def batch_generate(model, prompts, max_tokens):
    lengths = [len(p) for p in prompts]
    max_length = max(lengths)
    left_padding = [max_length - l for l in lengths]
    inputs = _left_pad_prompts(prompts, max_length)
    prompt_cache = _make_cache(model, left_padding, None)

    logits = model(inputs, cache=prompt_cache)[:, -1, :]
    tokens = logits.argmax(-1)
    out = [[t] for t in tokens.tolist()]
    step_logits = [logits]
    for _ in range(max_tokens - 1):
        logits = model(tokens[:, None], cache=prompt_cache)[:, -1, :]
        tokens = logits.argmax(-1)
        for row, t in zip(out, tokens.tolist()):
            row.append(t)
        step_logits.append(logits)
    return out, torch.stack(step_logits, 1)


config = TextConfig.from_dict(
    dict(
        model_type="gemma3n_text",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=97,
        num_key_value_heads=2,
        num_kv_shared_layers=0,
        sliding_window=512,
        max_position_embeddings=2048,
        rope_local_base_freq=10000.0,
        rope_theta=1000000.0,
        final_logit_softcapping=30.0,
        layer_types=["full_attention", "full_attention"],
    )
)
model = LanguageModel(config).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.02)

prompts = [
    [5, 17, 23, 42, 8, 61, 3, 29, 11],
    [7, 88, 14, 36],
]
generated, logits = batch_generate(model, prompts, max_tokens=6)
for i, row in enumerate(generated):
    print(f"prompt {i}: generated {row}")
print("logit checksum:", round(float(logits.float().abs().sum()), 4))
