"""open_lm `get_rectangular_mask`: the bottom-right causal triangle is placed in the columns of a
width padded to a multiple of 8, then the mask is cut back to k_seq_len, so the triangle is
shifted right (or cut away) and queries over a KV cache see later keys.

Citation: mlfoundations/open_lm PR #235 ("Generation fixes"), commit 81a4f32, open_lm/attention.py
(diff read; the PR adds doctests for the (3, 5) and (5, 5) cases).

Bug: `mask = torch.ones((q_seq_len, next_multiple_8)); mask[:, -q_seq_len:] = tril(...)` puts the
triangle in the last q_seq_len of next_multiple_8 columns, and `[..., :k_seq_len]` then keeps the
first k_seq_len. Unless k_seq_len is a multiple of 8 the causal part lands to the right of where
the queries are. `torch_attn` uses this mask whenever `keys.shape[1] > queries.shape[1] > 1`: a
multi-token forward with `past_key_value` and `use_cache=True`.

Fix: build the bool mask at (q_seq_len, k_seq_len), then write it into the first k_seq_len
columns of the padded (multiple-of-8) float tensor and slice that.

Reproduction: a 2-layer open_lm `Transformer` (Params dataclass, CustomAttn with in_proj /
rotary / `attn_func=torch_attn`). A 4-token prompt is run with use_cache=True, then a 3-token
continuation with the cache: q_seq_len 3, k_seq_len 7 (padded width 8).
"""
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def get_rectangular_mask(shape, q_seq_len, k_seq_len, device, dtype):
    # xformers requires the mask to be built with a shape that is a multiple of 8
    # probably because of the way it is implemented in CUDA
    next_multiple_8 = (k_seq_len + 7) // 8 * 8  #
    if not FIXED:
        mask = torch.ones((q_seq_len, next_multiple_8), device=device, dtype=bool)
        mask[:, -q_seq_len:] = torch.tril(mask[:, -q_seq_len:], diagonal=0)
        return torch.zeros((*shape, q_seq_len, next_multiple_8), device=device, dtype=dtype).masked_fill(
            ~mask, float("-inf")
        )[:, :, :, :k_seq_len]
    mask = torch.ones((q_seq_len, k_seq_len), device=device, dtype=bool)
    mask[:, -q_seq_len:] = torch.tril(mask[:, -q_seq_len:], diagonal=0)
    output_mask = torch.zeros((*shape, q_seq_len, next_multiple_8), device=device, dtype=dtype)
    output_mask[:, :, :, :k_seq_len].masked_fill_(~mask, torch.finfo(dtype).min)
    return output_mask[:, :, :, :k_seq_len]


def torch_attn(queries, keys, values, is_causal):
    if is_causal and keys.shape[1] > queries.shape[1] > 1:
        q_seq_len = queries.shape[1]
        k_seq_len = keys.shape[1]
        mask = get_rectangular_mask((1, 1), q_seq_len, k_seq_len, queries.device, queries.dtype)
        return (
            F.scaled_dot_product_attention(
                queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
            )
            .transpose(1, 2)
            .contiguous()
        )
    elif queries.shape[1] == 1:
        return (
            F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
            .transpose(1, 2)
            .contiguous()
        )
    else:
        return (
            F.scaled_dot_product_attention(
                queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=is_causal
            )
            .transpose(1, 2)
            .contiguous()
        )


@dataclass
class Params:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    norm_eps: float = 1e-5
    seq_len: int = 64
    norm_type: type = nn.LayerNorm
    attn_func: Callable = torch_attn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryWithCast(nn.Module):
    def __init__(self, dim_model, seq_len):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim_model, 2).float() / dim_model))
        t = torch.arange(seq_len, dtype=torch.float32)
        emb = torch.cat([torch.einsum("i,j->ij", t, inv_freq)] * 2, dim=-1)
        self._cos_cached = emb.cos()[None, :, None, :]
        self._sin_cached = emb.sin()[None, :, None, :]

    def _rot(self, x, offset):
        cos = self._cos_cached[:, offset : offset + x.shape[1]]
        sin = self._sin_cached[:, offset : offset + x.shape[1]]
        return (x * cos) + (rotate_half(x) * sin)

    def forward(self, q, k, v, offset=0):
        return self._rot(q, offset), self._rot(k, offset), v


class CustomAttn(nn.Module):
    def __init__(self, layer_id, args: Params):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.in_proj = nn.Linear(args.dim, 3 * args.n_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.pos_embed = RotaryWithCast(self.head_dim, args.seq_len)
        self.attn_fn = args.attn_func
        self.layer_id = layer_id

    def forward(self, x, is_causal=True, past_key_value=None, use_cache=False):
        batchsize, q_len, _ = x.shape
        queries, keys, vals = self.in_proj(x).chunk(3, dim=-1)
        queries = queries.view(batchsize, q_len, self.n_heads, self.head_dim)
        keys = keys.view(batchsize, q_len, self.n_heads, self.head_dim)
        vals = vals.view(batchsize, q_len, self.n_heads, self.head_dim)

        past_length = 0 if past_key_value is None else past_key_value[0].shape[1]
        queries, keys, vals = self.pos_embed(queries, keys, vals, offset=past_length)

        if past_key_value is not None and use_cache:
            keys = torch.cat([past_key_value[0], keys], dim=1)
            vals = torch.cat([past_key_value[1], vals], dim=1)
        if use_cache:
            past_key_value = [keys, vals]

        output = self.attn_fn(queries, keys, vals, is_causal=is_causal)
        output = output.view(batchsize, q_len, -1)
        return self.out_proj(output), past_key_value


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, layer_id, args: Params):
        super().__init__()
        self.attention = CustomAttn(layer_id, args)
        self.feed_forward = SwiGLU(args.dim, 2 * args.dim)
        self.attention_norm = args.norm_type(args.dim, eps=args.norm_eps)
        self.ffn_norm = args.norm_type(args.dim, eps=args.norm_eps)

    def forward(self, x, past_key_value=None, use_cache=False):
        h, past_key_value = self.attention(
            self.attention_norm(x), is_causal=True, past_key_value=past_key_value, use_cache=use_cache
        )
        h = x + h
        return h + self.feed_forward(self.ffn_norm(h)), past_key_value


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(Block(i, params) for i in range(params.n_layers))
        self.norm = params.norm_type(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        std = 1.0 / math.sqrt(params.dim)
        nn.init.trunc_normal_(self.tok_embeddings.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, input, past_key_values=None, use_cache=False):
        x = self.tok_embeddings(input)
        if past_key_values is None:
            past_key_values = [None] * self.n_layers
        for i, layer in enumerate(self.layers):
            x, past_key_values[i] = layer(x, past_key_values[i], use_cache=use_cache)
        if past_key_values[0] is None:
            past_key_values = None
        x = self.norm(x)
        return self.output(x).float(), x, past_key_values


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Transformer(Params()).eval()
    prompt = torch.tensor([[5, 17, 3, 42]])
    continuation = torch.tensor([[8, 23, 11]])
    with torch.no_grad():
        _, _, past = model(prompt, use_cache=True)
        logits, _, past = model(continuation, past_key_values=past, use_cache=True)
    print("fixed" if FIXED else "buggy", logits[0].argmax(-1).tolist(), f"{logits[0, 0, :2].tolist()}")
