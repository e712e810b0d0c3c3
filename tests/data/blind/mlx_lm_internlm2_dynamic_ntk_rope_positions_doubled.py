# mlx-lm (ml-explore/mlx-lm#1606, commit 13425df6, "Fix InternLM2/InterLN3 DynamicNTKScalingRoPE"):
# mlx_lm/models/internlm2.py built its own DynamicNTKScalingRoPE with `scale=rope_scale`, where rope_scale was
# 1 / factor for "linear" scaling and 2.0 otherwise (InternLM2's checkpoints ship rope_scaling {"type": "dynamic",
# "factor": 2.0}). mx.fast.rope's `scale` multiplies the positions, so every query and key in the prompt chunks and in
# each cached decode step was rotated at 2 * (cache.offset + i); the NTK length was also read from x.shape[1] (the
# heads axis, x is (B, n_heads, L, D)). The fix moves the rope to rope_utils.DynamicNTKScalingRoPE (via
# initialize_rope): scale=1.0, positions at cache.offset + i, seq_len = max(x.shape[-2] + offset, max_position_embeddings).
# Ported from MLX to torch (mx.fast.rope written out, non-traditional halves; mx.fast.scaled_dot_product_attention's
# "causal" string as a bottom-right causal boolean mask; the GQA heads expanded), with generate_step's chunked prefill
# and decode loop over KVCache.
import sys
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

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


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def base_create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def fast_scaled_dot_product_attention(queries, keys, values, scale, mask):
    # mx.fast.scaled_dot_product_attention: GQA handled inside, "causal" = bottom-right causal
    n_repeats = queries.shape[1] // keys.shape[1]
    if n_repeats > 1:
        keys = keys.repeat_interleave(n_repeats, dim=1)
        values = values.repeat_interleave(n_repeats, dim=1)
    if isinstance(mask, str):
        qL, kL = queries.shape[-2], keys.shape[-2]
        q_indices = torch.arange(kL - qL, kL)
        k_indices = torch.arange(kL)
        mask = q_indices[:, None] >= k_indices[None]
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    return fast_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


# ---- mlx_lm/models/cache.py
def create_attention_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
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

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)


def make_prompt_cache(model):
    return [KVCache() for _ in range(len(model.layers))]


# ---- mx.fast.rope (traditional=False: the two halves of the first `dims` features rotate together)
def fast_rope(x, dims, traditional, base, scale, offset):
    L = x.shape[-2]
    positions = (torch.arange(L, dtype=torch.float32) + offset) * scale
    inv_freq = base ** (-torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    theta = positions[:, None] * inv_freq[None, :]
    cos, sin = theta.cos(), theta.sin()
    half = dims // 2
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class RoPE(nn.Module):
    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base
        self.scale = scale

    def forward(self, x, offset: int = 0):
        return fast_rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)


# ---- mlx_lm/models/rope_utils.py (after the fix)
class RopeUtilsDynamicNTKScalingRoPE(nn.Module):
    def __init__(self, dims: int, max_position_embeddings: int, traditional: bool, base: float, factor: float):
        super().__init__()
        self.dims = dims
        self.max_position_embeddings = max_position_embeddings
        self.traditional = traditional
        self.base = base
        self.factor = factor

    def forward(self, x, offset: int = 0):
        # x.shape: [batch, num_heads, seq_len, head_dim]
        seq_len = max(x.shape[-2] + offset, self.max_position_embeddings)
        base = self.base * (
            (self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)
        ) ** (self.dims / (self.dims - 2))
        return fast_rope(x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset)


def initialize_rope(dims, base, traditional, scaling_config: Optional[dict] = None,
                    max_position_embeddings: Optional[int] = None):
    if scaling_config is not None:
        rope_type = scaling_config.get("type") or scaling_config.get("rope_type", "default")
    else:
        rope_type = "default"

    if rope_type in ["default", "linear"]:
        scale = 1 / scaling_config["factor"] if rope_type == "linear" else 1.0
        return RoPE(dims, traditional=traditional, base=base, scale=scale)
    elif rope_type == "dynamic":
        return RopeUtilsDynamicNTKScalingRoPE(
            dims=dims,
            max_position_embeddings=max_position_embeddings,
            traditional=traditional,
            base=base,
            factor=scaling_config["factor"],
        )
    raise ValueError(f"Unsupported RoPE type {rope_type}")


# ---- mlx_lm/models/internlm2.py
@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    bias: bool = True
    max_position_embeddings: int = 32768
    num_key_value_heads: int = None
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

        if self.rope_scaling:
            required_keys = {"factor", "type"}
            if not all(key in self.rope_scaling for key in required_keys):
                raise ValueError(f"rope_scaling must contain keys {required_keys}")

            if self.rope_scaling["type"] not in ["linear", "dynamic"]:
                raise ValueError("rope_scaling 'type' currently only supports 'linear' or 'dynamic")


class DynamicNTKScalingRoPE(nn.Module):
    """Implements the rotary positional encoding with Dynamic NTK scaling."""

    def __init__(self, dims: int, max_position_embeddings: int = 2048, traditional: bool = False,
                 base: float = 10000, scale: float = 1.0):
        super().__init__()
        self.max_position_embeddings = max_position_embeddings
        self.original_base = base
        self.dims = dims
        self.traditional = traditional
        self.scale = scale

    def forward(self, x, offset: int = 0):
        seq_len = x.shape[1] + offset
        if seq_len > self.max_position_embeddings:
            base = self.original_base * (
                (self.scale * seq_len / self.max_position_embeddings) - (self.scale - 1)
            ) ** (self.dims / (self.dims - 2))
        else:
            base = self.original_base

        return fast_rope(x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def swiglu(gate, x):
    return F.silu(gate) * x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()

        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.n_kv_groups = n_heads // args.num_key_value_heads

        self.head_dim = head_dim = args.hidden_size // n_heads
        self.scale = head_dim**-0.5

        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=args.bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=args.bias)

        if FIXED:
            self.rope = initialize_rope(
                head_dim,
                base=args.rope_theta,
                traditional=args.rope_traditional,
                scaling_config=args.rope_scaling,
                max_position_embeddings=args.max_position_embeddings,
            )
        else:
            rope_scale = (
                1 / args.rope_scaling["factor"]
                if args.rope_scaling is not None and args.rope_scaling["type"] == "linear"
                else 2.0
            )

            self.rope = DynamicNTKScalingRoPE(
                head_dim,
                max_position_embeddings=args.max_position_embeddings,
                traditional=args.rope_traditional,
                base=args.rope_theta,
                scale=rope_scale,
            )

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        B, L, D = x.shape

        qkv_states = self.wqkv(x)
        qkv_states = qkv_states.reshape(B, L, -1, 2 + self.n_kv_groups, self.head_dim)

        queries = qkv_states[..., : self.n_kv_groups, :]
        queries = queries.reshape(B, L, -1, self.head_dim)
        keys = qkv_states[..., -2, :]
        values = qkv_states[..., -1, :]

        # Prepare the queries, keys and values for the attention computation
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.wo(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = MLP(args.hidden_size, args.intermediate_size)
        self.attention_norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        r = self.attention(self.attention_norm(x), mask, cache)
        h = x + r
        r = self.feed_forward(self.ffn_norm(h))
        out = h + r
        return out


class InternLM2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.vocab_size > 0
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args=args) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.tok_embeddings(inputs)

        if cache is None:
            cache = [None] * len(self.layers)

        mask = base_create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)

        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = InternLM2Model(args)
        if not args.tie_word_embeddings:
            self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            out = out @ self.model.tok_embeddings.weight.T
        else:
            out = self.output(out)
        return out

    @property
    def layers(self):
        return self.model.layers


# ---- mlx_lm/generate.py generate_step (greedy sampler, chunked prefill, then the decode loop)
def generate_step(prompt, model, *, max_tokens: int = 256, prefill_step_size: int = 2048):
    prompt_cache = make_prompt_cache(model)
    sampler = lambda x: torch.argmax(x, dim=-1)

    def _model_call(input_tokens):
        return model(input_tokens, cache=prompt_cache)

    def _step(input_tokens):
        logits = _model_call(input_tokens[None])
        logits = logits[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        sampled = sampler(logprobs)
        return sampled, logprobs.squeeze(0)

    total_prompt_tokens = len(prompt)
    prompt_processed_tokens = 0
    while total_prompt_tokens - prompt_processed_tokens > 1:
        remaining = (total_prompt_tokens - prompt_processed_tokens) - 1
        n_to_process = min(prefill_step_size, remaining)
        _model_call(prompt[:n_to_process][None])
        prompt_processed_tokens += n_to_process
        prompt = prompt[n_to_process:]

    y, logprobs = _step(prompt)

    n = 0
    while True:
        if n != max_tokens:
            next_y, next_logprobs = _step(y)
        if n == max_tokens:
            break
        yield y.item(), logprobs
        y, logprobs = next_y, next_logprobs
        n += 1


def main():
    config = {
        "model_type": "internlm2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 101,
        "bias": False,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "tie_word_embeddings": False,
    }
    args = ModelArgs.from_dict(config)
    model = Model(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    prompt = torch.tensor([5, 17, 42, 8, 63, 21, 90, 3, 77, 14, 56, 29])
    tokens, total_logprob = [], 0.0
    with torch.no_grad():
        for token, logprobs in generate_step(prompt, model, max_tokens=10, prefill_step_size=4):
            tokens.append(token)
            total_logprob += float(logprobs[token])
    print("generated:", tokens)
    print(f"sum of chosen logprobs: {total_logprob:.4f}")


if __name__ == "__main__":
    main()
