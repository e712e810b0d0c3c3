"""mlx-lm Gemma 3 text model: the mask chosen for layer 0 is kept for every later layer.

Citation: ml-explore/mlx-lm#39 ("Fix gemma3 and cohere2 sliding window"), commit 465b107c, the
`mlx_lm/models/gemma3_text.py` half (`Gemma3Model.__call__`). Ported from MLX to torch at tiny sizes:
`gemma3_text.py` (ModelArgs, Attention, TransformerBlock, Gemma3Model, Model.make_cache) at 465b107c^,
`base.py` (create_causal_mask, create_attention_mask), `cache.py` (KVCache, RotatingKVCache) and the
prefill + decode loop of `utils.generate_step`.

Bug: the layer loop wrote the chosen mask back into the `mask` argument (`mask = full_mask`) and the
flag it tested was named `is_sliding` while it is true on the global layers. Layer 0 (a sliding layer)
therefore got `full_mask`, and since `mask` was no longer None every later layer kept it: on a cached
prefill the sliding-window layers attend the whole causal prefix instead of their window.

Fix: the flag is renamed `is_global` and the per-layer mask goes into `local_mask`: global layers get
`full_mask`, sliding layers `sliding_window_mask`, and the caller's `mask` is left untouched.

Reproduction: a tiny Gemma 3 (5 sliding : 1 global, window 8, rotating caches from make_cache), one
20-token prompt prefilled with the prompt cache, then greedy decoding.
"""
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- mlx_lm/models/base.py -------------------------------------------------------------------------


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    lengths: Optional[torch.Tensor] = None,
):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds <= rinds + window_size)
    if lengths is not None:
        lengths = lengths[:, None, None, None]
        mask = mask & (rinds < lengths)
    return mask


def create_attention_mask(h: torch.Tensor, cache: Optional[Any] = None):
    T = h.shape[1]
    if T > 1:
        window_size = None
        offset = 0
        if cache is not None and cache[0] is not None:
            c = cache[0]
            if hasattr(c, "max_size"):
                offset = min(c.max_size, c.offset)
                window_size = c.max_size
            else:
                offset = c.offset
        mask = create_causal_mask(T, offset, window_size=window_size)
    else:
        mask = None
    return mask


# ---- mlx_lm/models/cache.py ------------------------------------------------------------------------


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0
        self.step = 256

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


class RotatingKVCache:
    def __init__(self, max_size=None, keep=0, step=256):
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self.step = step
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
        """
        Rearrange the cache into temporal order, slicing off the end if unused.
        """
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
            # Put the keys/values in temporal order to
            # preserve context
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)

            # The largest size is self.max_size + S to ensure
            # every token gets at least self.max_size context
            trim_size = self._idx - self.max_size
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        # May not have hit the max size yet, so potentially
        # keep growing the cache
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self.offset
        if self.keys is None or (
            prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size
        ):
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

        # Trim if needed
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size

        # Rotate
        if self._idx == self.max_size:
            self._idx = self.keep

        # Assign
        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self.offset += S
        self._idx += S

        # If the buffer is not full, slice off the end
        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)


def make_prompt_cache(model):
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in range(len(model.layers))]


# ---- mlx_lm/models/gemma3_text.py ------------------------------------------------------------------


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int = 1152
    num_hidden_layers: int = 26
    intermediate_size: int = 6912
    num_attention_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 262144
    num_key_value_heads: int = 1
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_traditional: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6


class RoPE(nn.Module):
    """mlx.nn.RoPE (traditional=False): rotate the two halves, positions start at `offset`."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base

    def forward(self, x, offset: int = 0):
        L = x.shape[-2]
        half = self.dims // 2
        inv_freq = 1.0 / (self.base ** (torch.arange(0, half, dtype=torch.float32) / half))
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        theta = pos[:, None] * inv_freq[None, :]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., :half], x[..., half : self.dims]
        rx1 = x1 * cos - x2 * sin
        rx2 = x1 * sin + x2 * cos
        return torch.cat([rx1, rx2, x[..., self.dims :]], dim=-1)


def scaled_dot_product_attention(queries, keys, values, scale, mask):
    # mx.fast.scaled_dot_product_attention: bool mask, True = attend; GQA by head groups
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        # mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * (1.0 + self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()

        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = args.head_dim
        self.layer_idx = layer_idx

        self.scale = args.query_pre_attn_scalar**-0.5

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

        self.q_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)
        self.is_sliding = (layer_idx + 1) % args.sliding_window_pattern != 0

        self.rope = RoPE(
            head_dim,
            traditional=args.rope_traditional,
            base=(
                args.rope_local_base_freq
                if self.is_sliding
                else args.rope_global_base_freq
            ),
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
        if mask is not None and mask.shape[-1] != keys.shape[-2]:
            mask = mask[..., -keys.shape[-2] :]

        output = scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
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
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.num_attention_heads = args.num_attention_heads
        self.hidden_size = args.hidden_size
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        out = h + self.post_feedforward_layernorm(r)
        return out


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.num_hidden_layers = args.num_hidden_layers
        assert self.vocab_size > 0
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [
                TransformerBlock(args=args, layer_idx=layer_idx)
                for layer_idx in range(args.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, mask=None, cache=None):
        h = self.embed_tokens(inputs)
        h = h * torch.tensor(self.args.hidden_size**0.5, dtype=torch.bfloat16).to(h.dtype)

        if cache is None:
            cache = [None] * len(self.layers)

        if mask is None:
            j = self.args.sliding_window_pattern
            full_mask = create_attention_mask(h, cache[j - 1 : j])
            sliding_window_mask = create_attention_mask(h, cache)

        if not FIXED:
            for i, (layer, c) in enumerate(zip(self.layers, cache)):
                is_sliding = (
                    i % self.args.sliding_window_pattern
                    == self.args.sliding_window_pattern - 1
                )

                if mask is None and is_sliding:
                    mask = sliding_window_mask
                elif mask is None:
                    mask = full_mask

                h = layer(h, mask, c)
        else:
            for i, (layer, c) in enumerate(zip(self.layers, cache)):
                is_global = (
                    i % self.args.sliding_window_pattern
                    == self.args.sliding_window_pattern - 1
                )

                local_mask = mask
                if mask is None and is_global:
                    local_mask = full_mask
                elif mask is None:
                    local_mask = sliding_window_mask

                h = layer(h, local_mask, c)

        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None, mask=None):
        out = self.model(inputs, mask, cache)
        out = self.lm_head(out)
        return out

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        caches = []
        for i in range(self.args.num_hidden_layers):
            if (
                i % self.args.sliding_window_pattern
                == self.args.sliding_window_pattern - 1
            ):
                caches.append(KVCache())
            else:
                caches.append(RotatingKVCache(max_size=self.args.sliding_window, keep=0))
        return caches


# ---- mlx_lm/utils.py generate_step (greedy sampler, no logits processors) --------------------------


@torch.no_grad()
def generate_step(prompt, model, *, max_tokens=256, prompt_cache=None, prefill_step_size=512):
    y = prompt
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model)

    sampler = lambda x: torch.argmax(x, dim=-1)

    def _step(y):
        logits = model(y[None], cache=prompt_cache)
        logits = logits[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = sampler(logprobs)
        return y, logprobs.squeeze(0)

    while y.numel() > prefill_step_size:
        model(y[:prefill_step_size][None], cache=prompt_cache)
        y = y[prefill_step_size:]

    y, logprobs = _step(y)

    n = 0
    while True:
        if n == max_tokens:
            break
        yield y.item(), logprobs
        y, logprobs = _step(y)
        n += 1


def main():
    torch.manual_seed(0)
    args = ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        vocab_size=97,
        num_key_value_heads=1,
        query_pre_attn_scalar=16,
        sliding_window=8,
        sliding_window_pattern=6,
    )
    model = Model(args).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.05)
        for p in model.parameters():
            if p.dim() == 2 and p is not model.model.embed_tokens.weight:
                p.normal_(0.0, 0.3)

    prompt = torch.randint(0, args.vocab_size, (20,))
    tokens = []
    first_logprobs = None
    for tok, logprobs in generate_step(prompt, model, max_tokens=8):
        if first_logprobs is None:
            first_logprobs = logprobs
        tokens.append(tok)

    print("fixed" if FIXED else "buggy")
    print("prompt:", prompt.tolist())
    print("first-token logprobs[:6]:", [round(v, 4) for v in first_logprobs[:6].tolist()])
    print("generated:", tokens)


if __name__ == "__main__":
    main()
