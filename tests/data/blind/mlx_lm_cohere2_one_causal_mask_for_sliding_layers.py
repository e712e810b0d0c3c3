"""mlx-lm Cohere2 builds one mask from the global layer's cache and gives it to every layer (torch port).

Citation: ml-explore/mlx-lm#39 ("Fix gemma3 and cohere2 sliding window", commit
465b107c2a55bb36ffa28138e5a7d64ccc419c15); the cohere2 half of the diff was read in the repository
history, the PR thread was not read.

Bug: ``CohereModel.__call__`` (mlx_lm/models/cohere2.py) made a single
``mask = create_attention_mask(h, cache[j - 1 : j])`` with ``j = sliding_window_pattern``.
``create_attention_mask`` reads the window from ``cache[0]`` of the list it gets, and ``cache[j - 1]`` is the
global layer's plain ``KVCache``, so the mask is plain causal; the sliding-window layers (which
``make_cache`` gives a ``RotatingKVCache(max_size=sliding_window)``) used it too and attended past their
window during a prompt longer than the window.
Fix: build ``full_mask`` from ``cache[j - 1 : j]`` and ``sliding_window_mask`` from ``cache`` (whose first
entry is a sliding layer's rotating cache) and pick per layer with ``i % pattern == pattern - 1``.

This program: the mlx code ported to torch (``mx.fast`` SDPA -> ``F.scaled_dot_product_attention`` with the
boolean mask; RoPE left out), a 2-layer Cohere2 (``sliding_window_pattern=2``: layer 0 sliding,
layer 1 global; ``sliding_window=3``) and an 8-token prompt prefilled into ``make_cache()``.
``--fixed`` applies the fix.
"""
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    model_type: str = "cohere2"
    hidden_size: int = 32
    head_dim: int = 8
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 64
    layer_norm_eps: float = 1e-5
    logit_scale: float = 0.0625
    sliding_window: int = 3
    sliding_window_pattern: int = 2


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds <= rinds + window_size)
    return mask


def create_attention_mask(h, cache: Optional[Any] = None):
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


class RotatingKVCache(KVCache):
    """Multi-token (prefill) path only: the concat update keeps every key of the prompt."""

    def __init__(self, max_size=None, keep=0):
        super().__init__()
        self.max_size = max_size
        self.keep = keep


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.use_sliding_window = (layer_idx + 1) % args.sliding_window_pattern != 0

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if self.use_sliding_window and mask is not None:
            key_len = keys.shape[-2]
            if mask.shape[-1] != key_len:
                mask = mask[..., -key_len:]
        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                                enable_gqa=True)
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, bias=False)

    def forward(self, x, mask=None, cache=None):
        h = self.input_layernorm(x)
        # parallel attention + MLP block
        return x + self.self_attn(h, mask, cache) + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class CohereModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args, i) for i in range(args.num_hidden_layers)])
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, bias=False)

    def forward(self, inputs, mask=None, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        if not FIXED:
            if mask is None:
                j = self.args.sliding_window_pattern
                mask = create_attention_mask(h, cache[j - 1: j])
            for layer, c in zip(self.layers, cache):
                h = layer(h, mask, c)
            return self.norm(h)
        if mask is None:
            j = self.args.sliding_window_pattern
            full_mask = create_attention_mask(h, cache[j - 1: j])
            sliding_window_mask = create_attention_mask(h, cache)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            is_global = i % self.args.sliding_window_pattern == self.args.sliding_window_pattern - 1
            local_mask = mask
            if mask is None and is_global:
                local_mask = full_mask
            elif mask is None:
                local_mask = sliding_window_mask
            h = layer(h, local_mask, c)
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
    model = CohereModel(ModelArgs()).eval()
    with torch.no_grad():
        h = model(torch.tensor([[5, 12, 40, 3, 27, 61, 9, 33]]), cache=model.make_cache())
    print("fixed" if FIXED else "buggy", "prefill last hidden[:4]:", [round(v, 4) for v in h[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
