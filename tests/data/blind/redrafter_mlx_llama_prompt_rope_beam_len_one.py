"""ReDrafter's MLX Llama with a pre-allocated KV cache: the prompt was run with beam_len=1.

Citation: apple/ml-recurrent-drafter#21 (commit 9706efb, "Fix error setting of beam_len and rename
beam_len into num_positions"); recurrent_drafting/mlx/modeling_llama.py (Attention.__call__),
recurrent_drafting/mlx/attention.py (causal_mask, bias), recurrent_drafting/mlx/kv_cache.py (View,
Cache) and recurrent_drafting/mlx/experiments/benchmark_autoregression.py (process_prompt,
generate_tokens) at 9706efb^.

The model's Attention splits the query_len tokens into query_len // beam_len beams of beam_len
tokens and rotates each beam with RoPE from offset key_cache.shape[2]. The benchmark's
process_prompt called ``base_model(prompt, 1, mask, sliced_cache)``: with beam_len=1 every prompt
token became a beam of its own, so all of them were rotated at the cache's offset 0 and cached so.
The fix passes the prompt's length (``our_model(prompt, prompt.shape[1], mask, sliced_cache)``),
renaming the argument num_positions.

Ported from MLX to torch (mx.fast.scaled_dot_product_attention -> F.scaled_dot_product_attention,
nn.RoPE(traditional=False) written out) at toy sizes with random weights; batch size 1 as upstream.
"""

import sys
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

LOG_0 = -50000.0


# ---- recurrent_drafting/mlx/attention.py ----
def causal_mask(padding_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    assert padding_mask.dtype in [torch.int32, torch.int64, torch.bool]
    batch_size, key_value_len = padding_mask.shape
    causal_mask = torch.tril(torch.full((key_value_len, key_value_len), True))
    batch_causal_mask = causal_mask[None, :, :].repeat_interleave(batch_size, dim=0)
    batch_causal_mask = torch.logical_and(batch_causal_mask, padding_mask[:, None, :].bool())
    assert query_len > 0
    batch_causal_mask = batch_causal_mask[:, -query_len:, :]
    return batch_causal_mask


def bias(causal_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (torch.logical_not(causal_mask) * LOG_0).to(dtype)


# ---- recurrent_drafting/mlx/kv_cache.py ----
class View:
    def __init__(self, cache: torch.Tensor, layer: int, kv: int):
        self._cache = cache
        self._layer = layer
        self._kv = kv
        self.length = 0

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        batch_size, n_heads, _, head_dim = self._cache.shape
        return (batch_size, n_heads, self.length, head_dim)

    def cat(self, new_kv: torch.Tensor) -> torch.Tensor:
        batch_size, n_heads, max_length, head_dim = self._cache.shape
        new_length = new_kv.shape[2]
        assert new_kv.shape == (batch_size, n_heads, new_length, head_dim)
        assert self.length + new_length <= max_length
        self._cache[:, :, self.length : self.length + new_length, :] = new_kv
        self.length += new_length
        return self._cache[:, :, 0 : self.length, :]


class Cache:
    def __init__(self, batch_size, max_length, n_layers, n_heads, head_dim, dtype) -> None:
        _sliced = []
        for layer in range(n_layers):
            key = torch.zeros([batch_size, n_heads, max_length, head_dim], dtype=dtype)
            val = torch.zeros([batch_size, n_heads, max_length, head_dim], dtype=dtype)
            _sliced.append((View(key, layer, 0), View(val, layer, 1)))
        self.sliced = tuple(_sliced)


# ---- recurrent_drafting/mlx/modeling_llama.py ----
@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads


class RoPE(nn.Module):
    """mlx.nn.RoPE(dims, traditional=False, base, scale) over the last two axes (L, D)."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0):
        super().__init__()
        assert not traditional
        self.dims, self.base, self.scale = dims, base, scale

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        L = x.shape[-2]
        half = self.dims // 2
        positions = (torch.arange(offset, offset + L, dtype=torch.float32)) * self.scale
        freqs = self.base ** (-torch.arange(0, half, dtype=torch.float32) / half)
        theta = positions[:, None] * freqs[None, :]
        cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half : self.dims]
        rx = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([rx, x[..., self.dims :]], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        head_dim = args.hidden_size // n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        rope_scale = 1
        self.rope = RoPE(head_dim, traditional=args.rope_traditional, base=args.rope_theta, scale=rope_scale)

    def forward(self, x, num_positions: int, mask, cache: Tuple[View, View]):
        # Only support batch_size = 1
        batch_size, query_len, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)

        # Assume no tree attention or any other input compression algorithm is applied
        beam_width = query_len // num_positions
        queries = queries.reshape(batch_size * beam_width, num_positions, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(batch_size * beam_width, num_positions, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(batch_size * beam_width, num_positions, self.n_kv_heads, -1).transpose(1, 2)

        # Compute RoPE
        key_cache, value_cache = cache
        queries = self.rope(queries, offset=key_cache.shape[2])
        keys = self.rope(keys, offset=value_cache.shape[2])

        queries = queries.transpose(1, 2).reshape(batch_size, query_len, self.n_heads, -1).transpose(1, 2)
        keys = keys.transpose(1, 2).reshape(batch_size, query_len, self.n_kv_heads, -1).transpose(1, 2)
        values = values.transpose(1, 2).reshape(batch_size, query_len, self.n_kv_heads, -1).transpose(1, 2)

        keys = key_cache.cat(keys)  # in-place
        values = value_cache.cat(values)  # in-place

        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        output = output.transpose(1, 2).reshape(batch_size, query_len, -1)
        return self.o_proj(output)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, num_positions, mask, cache):
        r = self.self_attn(self.input_layernorm(x), num_positions, mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, num_positions, mask, cache):
        h = self.embed_tokens(inputs)
        attn_bias = bias(mask, h.dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, num_positions, attn_bias, cache=c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.args = args

    def forward(self, inputs, num_positions, mask, cache):
        h = self.model(inputs, num_positions, mask, cache)
        return h, self.lm_head(h)


# ---- recurrent_drafting/mlx/experiments/benchmark_autoregression.py ----
def benchmark_our_model(model: Model, prompt: torch.Tensor, num_new_tokens: int):
    def process_prompt(prompt, our_model, sliced_cache):
        mask = causal_mask(torch.ones((1, prompt.shape[1]), dtype=torch.bool), prompt.shape[1])
        if FIXED:
            logits = our_model(prompt, prompt.shape[1], mask, sliced_cache)
        else:
            logits = our_model(prompt, 1, mask, sliced_cache)
        return logits[1][:, -1, :]

    def generate_tokens(logits, model, cache, prompt_len):
        out = []
        for i in range(num_new_tokens - 1):
            y = torch.argmax(torch.softmax(logits, dim=-1), dim=-1)
            out.append(int(y[0]))
            mask = causal_mask(torch.ones((1, prompt_len + i + 1), dtype=torch.bool), 1)
            logits = model(y[None], 1, mask, cache)[1][:, -1, :]
        out.append(int(torch.argmax(logits, dim=-1)[0]))
        return out

    cache = Cache(
        batch_size=1,
        max_length=prompt.shape[1] + num_new_tokens,
        n_layers=model.args.num_hidden_layers,
        n_heads=model.args.num_key_value_heads or model.args.num_attention_heads,
        head_dim=model.args.hidden_size // model.args.num_attention_heads,
        dtype=model.model.embed_tokens.weight.dtype,
    )
    logits = process_prompt(prompt, model, cache.sliced)
    return generate_tokens(logits, model, cache.sliced, prompt.shape[1])


def main():
    torch.manual_seed(0)
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=97,
        num_key_value_heads=2,
    )
    model = Model(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.5)
    prompt = torch.randint(0, args.vocab_size, (1, 12))  # batch size = 1
    with torch.no_grad():
        tokens = benchmark_our_model(model, prompt, num_new_tokens=8)
    print("generated:", tokens)


if __name__ == "__main__":
    main()
