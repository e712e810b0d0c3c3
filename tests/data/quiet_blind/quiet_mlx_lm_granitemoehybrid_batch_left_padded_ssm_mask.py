"""Correct program: mlx-lm's Granite 4.0 (GraniteMoeHybrid: Mamba2 mixers + attention layers, top-k MoE
with a shared MLP) in batched greedy generation over LEFT-padded prompts, ported from MLX to torch.

Citation: ml-explore/mlx-lm
  mlx_lm/models/granitemoehybrid.py @9a61743ebb43e1c195be17d096b130da8788fb70
    (GraniteMoeHybridMamba2Mixer._conv zeroing `conv_input` where the mask is False and keeping the
    last d_conv-1 inputs as the conv state; _ssm -> ssm_update; GraniteMoeHybridAttention with RoPE at
    `offset=cache.offset`; GraniteMoeHybridModel.__call__ building attn_mask = create_attention_mask(h,
    cache[fa_idx]) and mamba_mask = create_ssm_mask(h, cache[ssm_idx]) and handing each layer its kind's
    mask; Model.make_cache: ArraysCache(size=2) for mamba layers, KVCache for attention layers),
  mlx_lm/models/base.py, cache.py, ssm.py, generate.py @d78bf58e217c904ec282ed8da9b947491f78c022
    (create_causal_mask with left_padding; create_ssm_mask; ArraysCache.make_mask / advance with
    left_padding; BatchKVCache with offset = -left_padding and make_mask(N, offset=_idx,
    left_padding); segsum / ssm_attn (the SSD scan whose decay is -inf between masked positions);
    generate._left_pad_prompts and _make_cache turning KVCache into BatchKVCache(left_padding) and
    setting ArraysCache.left_padding).
  The generation loop is BatchGenerator's prefill-then-step trimmed to one prefill of the whole batch.

Three prompts of 7, 4 and 2 tokens are left padded with 0 (left_padding = [0, 3, 5]).  The attention
layers see a boolean causal mask with the pad keys of each row cut off; the Mamba2 layers see the 2-D
"position >= left_padding" mask, which zeroes the pad inputs of the conv and cuts the pad positions
out of the SSD decay matrix; RoPE positions count from each row's first real token.

Self-check against a reference written here: each prompt alone, with no cache (so "causal"/None masks),
re-run from scratch for every new token: the logits of every generated step and the 6 greedy tokens
of each row equal the reference's.
"""
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------- base.py / activations.py
def swiglu(gate, x):
    return F.silu(gate) * x


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dims, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def create_causal_mask(N, offset=0, window_size=None, right_padding=None, left_padding=None):
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


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def create_ssm_mask(h, cache=None):
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(h.shape[1])
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    # mx.fast.scaled_dot_product_attention: mask is "causal", a boolean array (True = attend) or None
    n_rep = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(n_rep, dim=1)
    values = values.repeat_interleave(n_rep, dim=1)
    if isinstance(mask, str):
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class RoPE(nn.Module):
    """nn.RoPE(dims, traditional=False, base): offset is an int or one offset per batch row."""

    def __init__(self, dims, base):
        super().__init__()
        self.dims = dims
        self.inv_freq = base ** (-torch.arange(0, dims, 2, dtype=torch.float32) / dims)

    def forward(self, x, offset=0):
        B, H, L, D = x.shape
        offset = torch.as_tensor(offset).reshape(-1, 1)  # (B or 1, 1)
        pos = (offset + torch.arange(L)[None]).to(torch.float32)  # (B, L)
        ang = pos[..., None] * self.inv_freq  # (B, L, D/2)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# ---------------------------------------------------------------- cache.py
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

    def make_mask(self, N, return_array=False, window_size=None):
        if N == 1:
            return None
        return "causal"


class ArraysCache:
    def __init__(self, size, left_padding: Optional[List[int]] = None):
        self.cache = [None] * size
        self.left_padding = None
        self.lengths = None
        if left_padding:
            self.left_padding = torch.tensor(left_padding)

    def __setitem__(self, idx, value):
        self.cache[idx] = value

    def __getitem__(self, idx):
        return self.cache[idx]

    def advance(self, N):
        if self.lengths is not None:
            self.lengths -= N
        if self.left_padding is not None:
            self.left_padding -= N

    def make_mask(self, N: int):
        if self.left_padding is not None:
            pos = torch.arange(N)
            return pos >= self.left_padding[:, None]
        elif self.lengths is not None:
            pos = torch.arange(N)
            return pos < self.lengths[:, None]
        else:
            return None


class BatchKVCache:
    def __init__(self, left_padding: List[int]):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._idx = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)


# ---------------------------------------------------------------- ssm.py
def compute_dt(dt, dt_bias, time_step_limit):
    dt = F.softplus(dt.float() + dt_bias)
    return dt.clamp(time_step_limit[0], time_step_limit[1])


def segsum(x, mask=None):
    l = x.shape[-1]
    if mask is not None:
        mask = mask[:, None]
        x = x * mask
    x = x[..., None].expand(*x.shape, l)
    x = torch.tril(x, -1)
    x_segsum = torch.cumsum(x, dim=-2)
    if mask is not None:
        x_segsum = torch.where(mask[..., None, :] & mask[..., None], x_segsum, -float("inf"))
    return x_segsum


def ssm_attn(x, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0), mask=None,
             lengths=None, step=256):
    b, l, h, dh = x.shape
    _, _, g, d = B.shape

    dt = compute_dt(dt, dt_bias, time_step_limit)
    repeats = h // g
    A = -torch.exp(A_log)
    dtA = dt * A.reshape(1, 1, -1)
    dtx = dt.reshape(b, l, h, 1) * x

    def _step(dtx, dtA, B, C, state, mask):
        s = dtx.shape[1]
        B = B.permute(0, 2, 3, 1)

        CB = C.transpose(1, 2) @ B
        CB = CB.repeat_interleave(repeats, dim=1)

        decay = torch.exp(segsum(dtA.transpose(1, 2), mask=mask))

        surrogate_attention_matrix = torch.tril(CB * decay, 0)

        y = surrogate_attention_matrix @ dtx.transpose(1, 2)
        y = y.transpose(1, 2)

        decay = decay[:, :, -1:, :]
        decay = decay.permute(0, 3, 1, 2)
        B = B.repeat_interleave(h // g, dim=1).transpose(2, 3)
        dtxdecay = dtx * decay
        dtxdecay = dtxdecay.transpose(1, 2).transpose(2, 3)

        next_state = dtxdecay @ B

        if state is not None:
            exp_dtA_cumsum = torch.exp(torch.cumsum(dtA, dim=-2))
            next_state = next_state + exp_dtA_cumsum[:, -1, :, None, None] * state
            C = C.reshape(b, s, g, 1, d, 1)
            y_prev = (state.reshape(b, 1, g, repeats, dh, d) @ C).squeeze(-1).flatten(2, 3)
            y = y + exp_dtA_cumsum[..., None] * y_prev
        return y.to(x.dtype), next_state

    ys = []
    for i in range(0, l, step):
        y, state = _step(dtx[:, i : i + step], dtA[:, i : i + step], B[:, i : i + step], C[:, i : i + step],
                         state, None if mask is None else mask[..., i : i + step])
        ys.append(y)
    y = torch.cat(ys, dim=1) + x * D.reshape(1, 1, h, 1)
    return y, state


def ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
               mask=None, lengths=None):
    # on CPU (no Metal) mlx-lm always takes the ssm_attn path
    return ssm_attn(hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask=mask,
                    lengths=lengths)


# ---------------------------------------------------------------- granitemoehybrid.py
@dataclass
class ModelArgs:
    model_type: str = "granitemoehybrid"
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 24
    num_hidden_layers: int = 4
    max_position_embeddings: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    attention_bias: bool = False
    embedding_multiplier: float = 0.3
    attention_multiplier: float = 0.25
    logits_scaling: float = 2.0
    residual_multiplier: float = 1.0
    layer_types: Tuple[str, ...] = ("mamba", "attention", "mamba", "attention")
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_local_experts: Optional[int] = 4
    num_experts_per_tok: Optional[int] = 2
    shared_intermediate_size: Optional[int] = 16
    mamba_n_heads: Optional[int] = 4
    mamba_d_head: Optional[int] = 8
    mamba_proj_bias: Optional[bool] = False
    mamba_d_state: Optional[int] = 8
    mamba_d_conv: Optional[int] = 4
    mamba_n_groups: Optional[int] = 2
    mamba_conv_bias: Optional[bool] = True
    mlp_bias: bool = False
    position_embedding_type: str = "rope"
    tie_word_embeddings: bool = True
    time_step_limit: Tuple[float, float] = (0.001, 100.0)

    @property
    def use_moe(self) -> bool:
        return bool(self.num_local_experts)


class GraniteMoeHybridRMSNormGated(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = swiglu(gate, hidden_states)
        return rms_norm(hidden_states, self.weight, self.eps)


class GraniteMoeHybridMamba2Mixer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.mamba_n_heads
        self.hidden_size = args.hidden_size
        self.ssm_state_size = args.mamba_d_state
        self.conv_kernel_size = args.mamba_d_conv
        self.intermediate_size = args.mamba_n_heads * args.mamba_d_head
        self.n_groups = args.mamba_n_groups
        self.head_dim = args.mamba_d_head
        self.time_step_limit = args.time_step_limit
        self.heads_per_group = self.num_heads // self.n_groups
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=args.mamba_d_conv, padding=0,
                                groups=self.conv_dim, bias=args.mamba_conv_bias)
        projection_size = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = nn.Linear(self.hidden_size, projection_size, bias=args.mamba_proj_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GraniteMoeHybridRMSNormGated(self.intermediate_size, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=args.mamba_proj_bias)

    def _conv(self, conv_input, cache, mask):
        if mask is not None:
            conv_input = torch.where(mask[..., None], conv_input, 0)

        if cache is not None:
            if cache[0] is None:
                conv_state = torch.zeros(conv_input.shape[0], self.conv_kernel_size - 1, self.conv_dim,
                                         dtype=conv_input.dtype)
            else:
                conv_state = cache[0]
            padded_input = torch.cat([conv_state, conv_input], dim=1)
            n_keep = self.conv_kernel_size - 1
            cache[0] = padded_input[:, -n_keep:, :]
        else:
            padded_input = F.pad(conv_input, (0, 0, self.conv_kernel_size - 1, 0))

        conv_output = self.conv1d(padded_input.transpose(1, 2)).transpose(1, 2)
        return F.silu(conv_output)

    def _ssm(self, hidden_states, B, C, dt, cache, mask):
        batch_size, seq_len, _ = hidden_states.shape
        hidden_states = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim)
        B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        if cache:
            state = cache[1]
            lengths = cache.lengths
        else:
            state, lengths = None, None
        y, state = ssm_update(hidden_states, self.A_log, B, C, self.D, dt, self.dt_bias, state,
                              self.time_step_limit, mask)
        if cache:
            cache[1] = state
        return y.reshape(batch_size, seq_len, self.intermediate_size)

    def forward(self, hidden_states, mask, cache=None):
        projected = self.in_proj(hidden_states)
        gate, conv_input, dt = torch.split(projected, [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv_output = self._conv(conv_input, cache, mask)
        hidden_states_ssm, B, C = torch.split(
            conv_output,
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size],
            dim=-1,
        )
        y = self._ssm(hidden_states_ssm, B, C, dt, cache, mask)
        if cache:
            cache.advance(y.shape[1])
        y = self.norm(y, gate)
        return self.out_proj(y)


class GraniteMoeHybridAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.hidden_size // n_heads
        self.scale = args.attention_multiplier
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=args.attention_bias)
        self.rope = RoPE(self.head_dim, args.rope_theta) if args.position_embedding_type != "nope" else None

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if self.rope is not None:
            if cache is not None:
                queries = self.rope(queries, offset=cache.offset)
                keys = self.rope(keys, offset=cache.offset)
            else:
                queries = self.rope(queries)
                keys = self.rope(keys)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class SwitchGLU(nn.Module):
    def __init__(self, input_dims, hidden_dims, num_experts):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(num_experts, hidden_dims, input_dims) * 0.2)
        self.up_proj = nn.Parameter(torch.randn(num_experts, hidden_dims, input_dims) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(num_experts, input_dims, hidden_dims) * 0.2)

    def forward(self, x, indices):
        # x (..., D), indices (..., k) -> (..., k, D)
        g = torch.einsum("...d,...khd->...kh", x, self.gate_proj[indices])
        u = torch.einsum("...d,...khd->...kh", x, self.up_proj[indices])
        return torch.einsum("...kh,...kdh->...kd", swiglu(g, u), self.down_proj[indices])


class GraniteMoeHybridTopKGating(nn.Module):
    def __init__(self, input_size, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states)
        top_k_logits, top_k_idx = torch.topk(logits, self.top_k, dim=-1)
        top_k_gates = torch.softmax(top_k_logits.float(), dim=-1)
        return top_k_idx, top_k_gates


class GraniteMoeHybridMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)
        self.router = GraniteMoeHybridTopKGating(args.hidden_size, args.num_local_experts, args.num_experts_per_tok)

    def forward(self, x):
        token_ids, gates = self.router(x)
        y = self.switch_mlp(x, token_ids)
        return (y * gates[..., None]).sum(dim=-2)


class GraniteMoeHybridSharedMLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_linear = nn.Linear(args.hidden_size, args.shared_intermediate_size * 2, bias=False)
        self.output_linear = nn.Linear(args.shared_intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        gate, up = torch.chunk(self.input_linear(x), 2, dim=-1)
        return self.output_linear(swiglu(gate, up))


class GraniteMoeHybridLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.residual_multiplier = args.residual_multiplier
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if layer_type == "mamba":
            self.mamba = GraniteMoeHybridMamba2Mixer(args)
        else:
            self.self_attn = GraniteMoeHybridAttention(args)
        self.shared_mlp = GraniteMoeHybridSharedMLP(args)
        self.block_sparse_moe = GraniteMoeHybridMoE(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        residual = x
        hidden_states = self.input_layernorm(x)
        if self.layer_type == "mamba":
            hidden_states = self.mamba(hidden_states, mask=mask, cache=cache)
        else:
            hidden_states = self.self_attn(hidden_states, mask=mask, cache=cache)
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        normed = self.post_attention_layernorm(hidden_states)
        mlp_out = self.block_sparse_moe(normed) + self.shared_mlp(normed)
        return residual + mlp_out * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([GraniteMoeHybridLayer(args, t) for t in args.layer_types])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.embedding_multiplier = args.embedding_multiplier
        self.fa_idx = args.layer_types.index("attention") if "attention" in args.layer_types else None
        self.ssm_idx = args.layer_types.index("mamba") if "mamba" in args.layer_types else None

    def forward(self, inputs, cache=None):
        hidden_states = self.embed_tokens(inputs) * self.embedding_multiplier
        if cache is None:
            cache = [None] * len(self.layers)
        attn_mask = None
        mamba_mask = None
        if self.fa_idx is not None:
            attn_mask = create_attention_mask(hidden_states, cache[self.fa_idx])
        if self.ssm_idx is not None:
            mamba_mask = create_ssm_mask(hidden_states, cache[self.ssm_idx])
        for layer, c in zip(self.layers, cache):
            mask = attn_mask if layer.layer_type == "attention" else mamba_mask
            hidden_states = layer(hidden_states, mask=mask, cache=c)
        return self.norm(hidden_states)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = GraniteMoeHybridModel(args)
        self.logits_scaling = args.logits_scaling

    def forward(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        out = out @ self.model.embed_tokens.weight.T
        return out / self.logits_scaling

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        caches = []
        for layer in self.layers:
            if layer.layer_type == "mamba":
                caches.append(ArraysCache(size=2))
            elif layer.layer_type == "attention":
                caches.append(KVCache())
        return caches


# ---------------------------------------------------------------- generate.py
def _left_pad_prompts(prompts, max_length=None):
    if max_length is None:
        max_length = max(len(p) for p in prompts)
    return torch.tensor([[0] * (max_length - len(p)) + p for p in prompts])


def _make_cache(model, left_padding, max_kv_size):
    def to_batch_cache(c):
        if type(c) is KVCache:
            return BatchKVCache(left_padding)
        elif isinstance(c, ArraysCache):
            c.left_padding = torch.tensor(left_padding)
            return c
        raise ValueError(f"{type(c)} does not yet support batching")

    return [to_batch_cache(c) for c in model.make_cache()]


def batch_generate(model, prompts, max_tokens):
    lengths = [len(p) for p in prompts]
    max_length = max(lengths)
    padding = [max_length - l for l in lengths]
    inputs = _left_pad_prompts(prompts, max_length)
    cache = _make_cache(model, padding, None)
    logits = model(inputs, cache=cache)[:, -1, :]
    tokens, step_logits = [], []
    for _ in range(max_tokens):
        y = logits.argmax(-1)
        tokens.append(y)
        step_logits.append(logits)
        logits = model(y[:, None], cache=cache)[:, -1, :]
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


# ---------------------------------------------------------------- run + self-check
args = ModelArgs()
model = Model(args).eval()
with torch.no_grad():
    for p in model.parameters():  # spread the weights a little so that routing and argmax are not ties
        p.add_(torch.randn_like(p) * 0.05)

prompts = [
    [1, 17, 33, 9, 44, 21, 5],
    [1, 40, 12, 27],
    [1, 60],
]
NEW = 6

with torch.no_grad():
    gen_tokens, gen_logits = batch_generate(model, prompts, NEW)

    for b, prompt in enumerate(prompts):
        seq = list(prompt)
        for step in range(NEW):
            ref = model(torch.tensor([seq]))[0, -1]  # cache=None: "causal" / no ssm mask
            assert torch.allclose(gen_logits[b, step], ref, atol=1e-4), (b, step, (gen_logits[b, step] - ref).abs().max())
            nxt = int(ref.argmax())
            assert int(gen_tokens[b, step]) == nxt, (b, step, gen_tokens[b].tolist())
            seq.append(nxt)

print("mlx-lm granitemoehybrid left-padded batch generation matches per-prompt runs:", gen_tokens.tolist())
