# ml-explore/mlx-lm#1024 (commit ed7884cb, "Fix missing cache advance from qwen 3.5"), mlx_lm/models/qwen3_5.py
# GatedDeltaNet.__call__, ported from MLX to torch.
# Qwen 3.5 is a hybrid: Gated DeltaNet (linear attention, ArraysCache holding conv state + recurrent state) layers
# and full-attention layers (BatchKVCache).  In batch_generate the prompts are left-padded and each ArraysCache is
# made with left_padding; create_ssm_mask asks cache.make_mask(N), which returns `arange(N) >= left_padding`.  The
# cache only learns that tokens went by through cache.advance(S).  Before the fix GatedDeltaNet never called
# cache.advance(S), so left_padding stayed at its prompt value: on every decode step arange(1) >= left_padding is
# False for a padded row, and its generated tokens are zeroed out of the conv and never update the recurrent state.
# The fix adds `cache.advance(S)` after storing the state.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ModelArgs:
    vocab_size = 64
    hidden_size = 32
    num_hidden_layers = 4
    full_attention_interval = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    linear_num_key_heads = 2
    linear_num_value_heads = 2
    linear_key_head_dim = 8
    linear_value_head_dim = 8
    linear_conv_kernel_dim = 4
    rms_norm_eps = 1e-6
    rope_theta = 10000.0


# ---- mlx_lm/models/cache.py -------------------------------------------------------------------------------
class ArraysCache:
    def __init__(self, size, left_padding=None):
        self.cache = [None] * size
        self.left_padding = torch.tensor(left_padding) if left_padding else None
        self.lengths = None

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


def create_causal_mask(N, offset=0, window_size=None, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if left_padding is not None:
        mask = mask & (rinds >= left_padding[:, None, None, None])
    return mask


class BatchKVCache:
    def __init__(self, left_padding):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = -self.left_padding
        self._idx = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding)


# ---- mlx_lm/models/base.py --------------------------------------------------------------------------------
def create_attention_mask(h, cache=None):
    return cache.make_mask(h.shape[1])


def create_ssm_mask(h, cache=None):
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(h.shape[1])
    return None


# ---- mlx_lm/models/gated_delta.py (ops path) --------------------------------------------------------------
def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask):
    B, S, H, Dk = k.shape
    Dv = v.shape[-1]
    beta = torch.sigmoid(b)
    g = torch.exp(-torch.exp(A_log) * F.softplus(a + dt_bias))
    if state is None:
        state = torch.zeros(B, H, Dv, Dk)
    ys = []
    for t in range(S):
        old_state = state
        state = state * g[:, t, :, None, None]
        kv_mem = (state * k[:, t, :, None, :]).sum(-1)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, None, :] * delta[..., None]
        y = (state * q[:, t, :, None, :]).sum(-1)
        if mask is not None:
            m = mask[:, t][:, None, None, None]
            state = torch.where(m, state, old_state)
        ys.append(y)
    return torch.stack(ys, 1), state


def rms_norm(x, w, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


class RMSNormGated(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x, gate):
        return rms_norm(x, self.weight, self.eps) * F.silu(gate)


# ---- mlx_lm/models/qwen3_5.py -----------------------------------------------------------------------------
class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, bias=False, kernel_size=self.conv_kernel_size,
                                groups=self.conv_dim, padding=0)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0, 16)))
        self.norm = RMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def forward(self, inputs, mask=None, cache=None):
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)

        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = torch.zeros(B, self.conv_kernel_size - 1, self.conv_dim)

        if mask is not None:
            qkv = torch.where(mask[..., None], qkv, 0)
        conv_input = torch.cat([conv_state, qkv], dim=1)
        if cache is not None:
            cache[0] = conv_input[:, -(self.conv_kernel_size - 1):]
        conv_out = F.silu(self.conv1d(conv_input.transpose(1, 2)).transpose(1, 2))

        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]

        state = cache[1] if cache else None
        inv_scale = k.shape[-1] ** -0.5
        q = (inv_scale ** 2) * rms_norm(q, None, 1e-6)
        k = inv_scale * rms_norm(k, None, 1e-6)

        out, state = gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state, mask)

        if cache is not None:
            cache[1] = state
            if FIXED:
                cache.advance(S)

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


def rope(x, offset, base):
    # x: (B, H, L, D); offset: (B,) per-row positions of the first query
    B, H, L, D = x.shape
    pos = offset[:, None] + torch.arange(L)[None]
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None, :, None].float() * inv
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        queries = rope(queries, cache.offset, self.rope_theta)
        keys = rope(keys, cache.offset, self.rope_theta)
        keys, values = cache.update_and_fetch(keys, values)
        rep = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(rep, 1)
        values = values.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args, layer_idx):
        super().__init__()
        self.is_linear = (layer_idx + 1) % args.full_attention_interval != 0
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, 64, bias=False), nn.SiLU(),
                                 nn.Linear(64, args.hidden_size, bias=False))

    def forward(self, x, mask=None, cache=None):
        if self.is_linear:
            r = self.linear_attn(self.input_layernorm(x), mask, cache)
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(args, i) for i in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ssm_idx = 0
        self.fa_idx = args.full_attention_interval - 1

    def forward(self, inputs, cache):
        hidden_states = self.embed_tokens(inputs)
        fa_mask = create_attention_mask(hidden_states, cache[self.fa_idx])
        ssm_mask = create_ssm_mask(hidden_states, cache[self.ssm_idx])
        for layer, c in zip(self.layers, cache):
            mask = ssm_mask if layer.is_linear else fa_mask
            hidden_states = layer(hidden_states, mask=mask, cache=c)
        return self.norm(hidden_states)


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = Qwen3_5TextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache):
        return self.lm_head(self.model(inputs, cache))

    def make_cache(self, left_padding):
        return [ArraysCache(size=2, left_padding=list(left_padding)) if l.is_linear
                else BatchKVCache(list(left_padding)) for l in self.model.layers]


# ---- mlx_lm/generate.py (batch_generate, greedy) ----------------------------------------------------------
def batch_generate(model, prompts, max_tokens):
    max_len = max(len(p) for p in prompts)
    left_padding = [max_len - len(p) for p in prompts]
    inputs = torch.tensor([[0] * lp + p for lp, p in zip(left_padding, prompts)])
    cache = model.make_cache(left_padding)
    logits = model(inputs, cache)[:, -1]
    y = logits.argmax(-1)
    out = [y]
    for _ in range(max_tokens - 1):
        logits = model(y[:, None], cache)[:, -1]
        y = logits.argmax(-1)
        out.append(y)
    return torch.stack(out, 1), logits


def main():
    model = Model(ModelArgs()).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "conv1d" in n:
                p.mul_(4.0)
        prompts = [[5, 17, 9, 33, 2, 41, 8, 12], [7, 3, 29]]
        tokens, last_logits = batch_generate(model, prompts, max_tokens=8)
    for i, row in enumerate(tokens.tolist()):
        print(f"prompt {i}: generated {row}")
    print("last step logits (row 1, first 6):", [round(v, 4) for v in last_logits[1, :6].tolist()])


if __name__ == "__main__":
    main()
