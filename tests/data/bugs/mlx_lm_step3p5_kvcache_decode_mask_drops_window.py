"""mlx-lm: a plain KVCache's make_mask drops the sliding window on decode steps (Step 3.5 port).

Citation: ml-explore/mlx-lm#843 ("Fix sliding window mask during generation", commit
25a4c8369e3c5a856a0491844eb98c3234a4cd84).  The diff and its regression test were read in the repository
history; the PR discussion was not read.

Bug: ``mlx_lm/models/cache.py::create_attention_mask(N, offset, return_array, window_size)`` (used by
``KVCache.make_mask``) began with ``if N == 1: return None`` and otherwise returned the string ``"causal"``
unless an array was asked for, so ``window_size`` was only honoured when ``return_array`` was set.  Models
whose sliding-window layers keep a plain ``KVCache`` -- here Step 3.5 (``step3p5.py``: ``make_cache`` returns
``[KVCache() for _ in self.layers]``, and ``Step3p5Model`` builds ``swa_mask = create_attention_mask(h,
cache[self._swa_idx], window_size=self.args.sliding_window)``) -- attended to the whole cache on every
generated token once the sequence passed ``sliding_window``.
Fix: ``if window_size is not None: return create_causal_mask(N, offset, window_size=window_size)`` before
the ``N == 1`` shortcut ("make window mask for regular cache").

This program: the mlx code ported to torch (``mx.fast.scaled_dot_product_attention`` ->
``F.scaled_dot_product_attention``; mask ``None`` = no mask, ``"causal"`` = ``is_causal``, array =
``attn_mask``), a 2-layer Step 3.5 (layer 0 sliding, layer 1 full; the MoE feed-forward replaced by its dense
SwiGLU MLP), ``sliding_window=4``, a 3-token prompt and 4 greedy decode steps through ``make_cache()``.
``--fixed`` applies the fix to ``create_attention_mask``.
"""
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    model_type: str = "step3p5"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    vocab_size: int = 64
    num_attention_heads: int = 4
    num_attention_groups: int = 2
    head_dim: int = 8
    intermediate_size: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 4
    layer_types: Optional[List[str]] = None
    use_head_wise_attn_gate: bool = True


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
    """cache.py's create_attention_mask (KVCache.make_mask)."""
    if FIXED:
        if window_size is not None:
            return create_causal_mask(N, offset, window_size=window_size)
        elif N == 1:
            return None
        elif return_array:
            return create_causal_mask(N, offset, window_size=window_size)
        else:
            return "causal"
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


def base_create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    """base.py's create_attention_mask."""
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


def rope(x, offset, base):
    d = x.shape[-1] // 2
    inv = base ** (-torch.arange(d, dtype=torch.float32) / d)
    ang = (torch.arange(offset, offset + x.shape[-2], dtype=torch.float32)[:, None] * inv)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)


class Step3p5Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        layer_types = args.layer_types or []
        if layer_types:
            self.is_sliding = layer_types[layer_idx] == "sliding_attention"
        else:
            self.is_sliding = layer_idx % 2 == 0
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_attention_groups
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.use_head_wise_attn_gate = args.use_head_wise_attn_gate
        if self.use_head_wise_attn_gate:
            self.g_proj = nn.Linear(dim, self.num_heads, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.num_heads, -1)).transpose(1, 2)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.num_kv_heads, -1)).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.num_kv_heads, -1).transpose(1, 2)
        offset = cache.offset if cache is not None else 0
        queries = rope(queries, offset, self.rope_theta)
        keys = rope(keys, offset, self.rope_theta)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2)
        if self.use_head_wise_attn_gate:
            output = output * torch.sigmoid(self.g_proj(x))[..., None]
        return self.o_proj(output.reshape(B, L, -1))


class Step3p5MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Step3p5DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Step3p5Attention(args, layer_idx)
        self.is_sliding = self.self_attn.is_sliding
        self.mlp = Step3p5MLP(args)
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Step3p5Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.num_layers = args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([Step3p5DecoderLayer(args, i) for i in range(args.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._swa_idx = next((i for i, l in enumerate(self.layers) if l.is_sliding), None)
        self._full_idx = next((i for i, l in enumerate(self.layers) if not l.is_sliding), None)

    def forward(self, x, cache=None):
        h = self.embed_tokens(x)
        if cache is None:
            cache = [None] * self.num_layers
        full_mask = None
        swa_mask = None
        if self._full_idx is not None:
            full_mask = base_create_attention_mask(h, cache[self._full_idx])
        if self._swa_idx is not None:
            swa_mask = base_create_attention_mask(h, cache[self._swa_idx], window_size=self.args.sliding_window)
        for layer, c in zip(self.layers, cache):
            mask = swa_mask if layer.is_sliding else full_mask
            h = layer(h, mask=mask, cache=c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Step3p5Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [KVCache() for _ in self.layers]


def main():
    torch.manual_seed(0)
    model = Model(ModelArgs()).eval()
    prompt_cache = model.make_cache()
    y = torch.tensor([[5, 23, 41]])
    tokens = []
    with torch.no_grad():
        for _ in range(5):  # prefill, then one token per step
            logits = model(y, cache=prompt_cache)[:, -1, :]
            y = logits.argmax(-1, keepdim=True)
            tokens.append(int(y))
    print("fixed" if FIXED else "buggy", "tokens:", tokens, "last logits[:3]:",
          [round(v, 4) for v in logits[0, :3].tolist()])


if __name__ == "__main__":
    main()
