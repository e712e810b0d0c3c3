"""mlx-lm Gemma 2 adds the boolean causal mask to its soft-capped scores (torch port).

Citation: ml-explore/mlx-lm#27 ("fix mask for gemma2", commit 1dc5de4fcec61820a5c784fefaa8ac573d11c94a).
The diff was read in the repository history; the PR thread was not read.

Bug: ``mlx_lm.models.base.create_attention_mask`` had switched to returning the *boolean* mask of
``create_causal_mask`` (True = may attend), but Gemma 2's ``Attention.__call__`` computes attention by hand
(it soft-caps the logits, ``tanh(scores / 50) * 50``, so it cannot use the fused SDPA) and still did
``scores = scores + mask``: True adds 1 and False adds 0, so no key is masked and every prompt token attends
to the tokens after it during prefill.
Fix: ``if mask.dtype == mx.bool_: scores = mx.where(mask, scores, finfo.min) else: scores = scores + mask``.

This program: Gemma 2's model code ported line for line from mlx to torch (``mx.where`` ->
``torch.where``, ``mx.softmax(precise=True)`` -> float32 softmax; RoPE left out), a 2-layer model with a
plain ``KVCache``, a 6-token prompt prefilled through the cache and 2 greedy decode steps (one query, no mask).
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
    model_type: str = "gemma2"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    vocab_size: int = 64
    num_key_value_heads: int = 2
    attn_logit_softcapping: float = 50.0
    final_logit_softcapping: float = 30.0
    query_pre_attn_scalar: float = 8.0


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


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = 1.0 / (args.query_pre_attn_scalar ** 0.5)
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.attn_logit_softcapping = args.attn_logit_softcapping

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        queries = queries * self.scale
        if self.repeats > 1:
            queries = queries.reshape(B, self.n_kv_heads, self.repeats, L, self.head_dim)
            keys = keys.unsqueeze(2)
            values = values.unsqueeze(2)
        scores = queries @ keys.transpose(-1, -2)
        scores = torch.tanh(scores / self.attn_logit_softcapping)
        scores *= self.attn_logit_softcapping
        if mask is not None:
            if FIXED and mask.dtype == torch.bool:
                scores = torch.where(mask, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
            else:
                scores = scores + mask
        scores = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        output = scores @ values
        if self.repeats > 1:
            output = output.reshape(B, self.n_heads, L, self.head_dim)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, args.intermediate_size, bias=False), nn.GELU("tanh"),
                                 nn.Linear(args.intermediate_size, args.hidden_size, bias=False))
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r)


class GemmaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args=args) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, mask=None, cache=None):
        h = self.embed_tokens(inputs)
        h = h * (self.args.hidden_size ** 0.5)
        if mask is None:
            mask = create_attention_mask(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.final_logit_softcapping = args.final_logit_softcapping
        self.model = GemmaModel(args)

    def forward(self, inputs, mask=None, cache=None):
        out = self.model(inputs, mask, cache)
        out = out @ self.model.embed_tokens.weight.T
        out = torch.tanh(out / self.final_logit_softcapping)
        return out * self.final_logit_softcapping


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = Model(args).eval()
    cache = [KVCache() for _ in range(args.num_hidden_layers)]
    y = torch.tensor([[2, 19, 44, 7, 31, 58]])
    tokens = []
    with torch.no_grad():
        for _ in range(3):
            logits = model(y, cache=cache)[:, -1, :]
            y = logits.argmax(-1, keepdim=True)
            tokens.append(int(y))
    print("fixed" if FIXED else "buggy", "tokens:", tokens, "logits[:3]:", [round(v, 4) for v in logits[0, :3].tolist()])


if __name__ == "__main__":
    main()
