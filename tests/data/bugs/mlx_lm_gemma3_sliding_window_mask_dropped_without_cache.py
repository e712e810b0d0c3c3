"""mlx-lm Gemma 3 text model: sliding-window layers attend full-causal when called without a cache.

Citation: ml-explore/mlx-lm#430 ("Changes needed to facilitate batching"), item 2 of its description:
"Fix bug with some sliding window attention models where we would not use a sliding window mask when no
cache is provided (e.g. fine-tuning, dwq, etc)".

Bug: before #430, ``create_attention_mask(h, cache)`` only learnt a window from the cache object
(``RotatingKVCache.max_size``).  Gemma 3's model built its sliding-window mask as
``create_attention_mask(h, cache)`` and, with no cache (training / LoRA fine-tuning / DWQ calibration,
where ``cache = [None] * num_layers``), got the plain ``"causal"`` string: every sliding layer attended the
whole causal past although ``args.sliding_window`` says it must only see the last ``sliding_window`` keys.

Fix: #430 gave ``create_attention_mask`` a ``window_size`` argument and the model passes
``window_size=self.window_size`` (its ``args.sliding_window``), so the window mask is built as an array even
without a cache.

This program is a torch port of the MLX model code (same names: ModelArgs, create_attention_mask,
create_causal_mask, sliding_window_pattern); ``mx.fast.scaled_dot_product_attention`` becomes
``F.scaled_dot_product_attention`` (the ``"causal"`` string becomes ``is_causal=True``).  A 12-token
training forward with ``sliding_window=4`` reaches the sliding layers: buggy = full causal, fixed = window 4.
The upstream diff was read from the PR description only; the helper bodies follow mlx-lm's base.py.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    model_type: str = "gemma3_text"
    hidden_size: int = 32
    num_hidden_layers: int = 4
    intermediate_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    vocab_size: int = 50
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    query_pre_attn_scalar: float = 8.0
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


if not FIXED:

    def create_attention_mask(h, cache=None, return_array: bool = False):
        T = h.shape[1]
        if T > 1:
            offset = 0
            window_size = None
            if cache is not None and cache[0] is not None:
                c = cache[0]
                offset = c.offset
                if hasattr(c, "max_size"):
                    window_size = c.max_size
                    offset = min(window_size, offset)
                    return_array = return_array or offset + T > window_size
            if return_array:
                return create_causal_mask(T, offset, window_size=window_size)
            return "causal"
        return None

else:

    def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
        N = h.shape[1]
        if cache and hasattr(cache, "make_mask"):
            return cache.make_mask(N, return_array=return_array, window_size=window_size)
        if N == 1:
            return None
        if return_array or (window_size and N > window_size):
            return create_causal_mask(N, window_size=window_size)
        return "causal"


def scaled_dot_product_attention(queries, keys, values, scale, mask):
    if isinstance(mask, str) and mask == "causal":
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale, is_causal=True)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class RMSNorm(nn.Module):
    def __init__(self, dims, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


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
        queries = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        output = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = nn.Sequential(
            nn.Linear(args.hidden_size, args.intermediate_size, bias=False),
            nn.GELU(approximate="tanh"),
            nn.Linear(args.intermediate_size, args.hidden_size, bias=False),
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

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
        self.layers = nn.ModuleList([TransformerBlock(args, i) for i in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, inputs, mask=None, cache=None):
        h = self.embed_tokens(inputs) * self.args.hidden_size ** 0.5
        if cache is None:
            cache = [None] * len(self.layers)
        if mask is None:
            j = self.sliding_window_pattern
            if not FIXED:
                full_mask = create_attention_mask(h, cache[j - 1 : j])
                sliding_window_mask = create_attention_mask(h, cache)
            else:
                full_mask = create_attention_mask(h, cache[j - 1])
                sliding_window_mask = create_attention_mask(h, cache[0], window_size=self.window_size)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            is_global = i % self.sliding_window_pattern == self.sliding_window_pattern - 1
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
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, mask=None, cache=None):
        return self.lm_head(self.model(inputs, mask, cache))


def main():
    torch.manual_seed(0)
    model = Model(ModelArgs()).eval()
    batch = torch.randint(1, 50, (2, 13))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    # the LoRA / DWQ training loss: a full-sequence forward with no cache
    with torch.no_grad():
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    print(f"{'fixed' if FIXED else 'buggy'} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
