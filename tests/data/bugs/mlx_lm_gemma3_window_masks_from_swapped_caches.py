"""mlx-lm Gemma 3 builds its global and sliding-window masks from each other's caches (torch port).

Citation: ml-explore/mlx-lm#465 ("fix gemma3 window", commit 9a11a81adda64719cad79e932fd795e13c72e55e).
The PR thread was not read; the diff was read in the repository history.

Bug: ``Gemma3Model.__call__`` (mlx_lm/models/gemma3_text.py) made
``global_mask = create_attention_mask(h, cache[0])`` and
``sliding_window_mask = create_attention_mask(h, cache[self.sliding_window_pattern - 1], window_size=...)``.
``make_cache`` gives the sliding layers (``cache[0]``) a ``RotatingKVCache(max_size=sliding_window)`` and the
global layers (``cache[pattern - 1]``) a plain ``KVCache``, so the masks came from the wrong caches:
``RotatingKVCache.make_mask`` falls back to ``window_size = self.max_size`` and gave the *global* layers a
windowed mask once the prompt is longer than the window, while ``KVCache.make_mask`` ignores
``window_size`` (returns "causal") and gave the *sliding* layers full causal attention.
Fix: swap the two cache indices (global mask from ``cache[pattern - 1]``, window mask from ``cache[0]``).

This program: the mlx code ported line for line to torch (``mx`` ops -> torch, ``mx.fast`` SDPA ->
``F.scaled_dot_product_attention``, where the string mask "causal" becomes ``is_causal=True``), a
2-layer Gemma 3 (``sliding_window_pattern=2``: layer 0 sliding, layer 1 global, ``sliding_window=4``), and a
9-token prompt prefilled into ``model.make_cache()``.  ``--fixed`` swaps the indices back.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    model_type: str = "gemma3_text"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 8
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 64
    num_key_value_heads: int = 2
    query_pre_attn_scalar: float = 8
    sliding_window: int = 4
    sliding_window_pattern: int = 2


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def create_attention_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
    if N == 1:
        return None
    if return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    else:
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

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)


class RotatingKVCache:
    def __init__(self, max_size=None, keep=0):
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    def update_and_fetch(self, keys, values):
        # multi-token step (_update_concat): keep everything, the largest size is max_size + S
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            trim_size = self._idx - self.max_size
            if trim_size > 0:
                self.keys = torch.cat([self.keys[..., : self.keep, :], self.keys[..., trim_size + self.keep:, :]], 2)
                self.values = torch.cat([self.values[..., : self.keep, :], self.values[..., trim_size + self.keep:, :]], 2)
            self.keys = torch.cat([self.keys, keys], 2)
            self.values = torch.cat([self.values, values], 2)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            else:
                return "causal"
        return None


def create_attention_mask_h(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    """mlx_lm.models.base.create_attention_mask (the name clashes with cache.py's in this single file)."""
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    if isinstance(mask, str):
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.is_sliding = (layer_idx + 1) % args.sliding_window_pattern != 0

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        # Sliding window
        if isinstance(mask, torch.Tensor) and mask.shape[-1] != keys.shape[-2]:
            mask = mask[..., -keys.shape[-2]:]
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, args.intermediate_size, bias=False), nn.GELU("tanh"),
                                 nn.Linear(args.intermediate_size, args.hidden_size, bias=False))
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.mlp(h)


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.window_size = args.sliding_window
        self.sliding_window_pattern = args.sliding_window_pattern
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args=args, layer_idx=i) for i in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs) * self.args.hidden_size ** 0.5
        if cache is None:
            cache = [None] * len(self.layers)
        if FIXED:
            global_mask = create_attention_mask_h(h, cache[self.sliding_window_pattern - 1])
            sliding_window_mask = create_attention_mask_h(h, cache[0], window_size=self.window_size)
        else:
            global_mask = create_attention_mask_h(h, cache[0])
            sliding_window_mask = create_attention_mask_h(
                h, cache[self.sliding_window_pattern - 1], window_size=self.window_size)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            is_global = i % self.sliding_window_pattern == self.sliding_window_pattern - 1
            mask = global_mask if is_global else sliding_window_mask
            h = layer(h, mask, c)
        return self.norm(h)

    def make_cache(self):
        caches = []
        for i in range(self.args.num_hidden_layers):
            if i % self.args.sliding_window_pattern == self.args.sliding_window_pattern - 1:
                caches.append(KVCache())
            else:
                caches.append(RotatingKVCache(max_size=self.args.sliding_window, keep=0))
        return caches


def main():
    torch.manual_seed(0)
    model = Gemma3Model(ModelArgs()).eval()
    prompt = torch.tensor([[2, 17, 33, 5, 41, 8, 60, 12, 29]])
    cache = model.make_cache()
    with torch.no_grad():
        h = model(prompt, cache=cache)
    print("fixed" if FIXED else "buggy", "prefill last hidden[:4]:", [round(v, 4) for v in h[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
