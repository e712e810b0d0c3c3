# rajveer43/VeloxQuant-MLX#195 ("fix(cache): generalize RoPE offset fix to L2Norm cache", fixes #174).
#
# veloxquant_mlx/cache/knorm_cache.py: L2NormKVCache keeps at most knorm_budget tokens per head (the first
# knorm_n_sink always, then the lowest key norms) and hands the retained rows back through the base mlx_lm
# KVCache by resetting self.keys / self.values / self.offset = 0 and calling super().update_and_fetch.
# After that call self.offset is the retained row count, not the number of tokens seen.  mlx_lm's
# attention rotates the query and the incoming key at offset=cache.offset before update_and_fetch, so once
# eviction pins the kept set at the budget every later decode token is numbered at the same stale
# position while the kept keys carry their true rotations.
# The fix tracks _true_offset (+= S each call) and reports it as self.offset after the base update.
#
# Ported to torch: mlx_lm's KVCache, a small mlx_lm-style llama (rope at cache.offset, causal mask from
# the offset, no mask for one-token steps), the L2Norm cache with a per-head keep-lowest-norm update, and
# mlx_lm's greedy generate loop.  Runs on CPU.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- mlx_lm.models.cache.KVCache (torch)
class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        # MLX arrays are values: writing past `offset` never touches a shared (stored) buffer.
        prev = self.offset
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys[..., :prev, :], keys], dim=2)
            self.values = torch.cat([self.values[..., :prev, :], values], dim=2)
        self.offset += keys.shape[2]
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


def make_prompt_cache(model):
    return [KVCache() for _ in model.layers]


def create_causal_mask(N: int, offset: int = 0):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    return linds[:, None] >= rinds[None]


def create_attention_mask(h, cache=None):
    N = h.shape[1]
    if N == 1:
        return None
    return create_causal_mask(N, cache.offset if cache is not None else 0)


# ---------------------------------------------------------------- mlx_lm.models.llama (torch)
@dataclass
class ModelArgs:
    model_type: str = "llama"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    vocab_size: int = 96
    rope_theta: float = 10000.0


class RoPE(nn.Module):
    def __init__(self, dims, base):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset: int = 0):
        L, D = x.shape[-2], self.dims
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        inv = self.base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = pos[:, None] * inv[None]
        cos, sin = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.rope = RoPE(self.head_dim, args.rope_theta)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        output = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0] if cache is not None else None)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.lm_head(self.norm(h))


# ---------------------------------------------------------------- veloxquant_mlx/quantizers/knorm.py (per head)
@dataclass
class KnormState:
    n_sink: int
    budget: int
    keep: str
    keys: torch.Tensor = None     # (n_kept, D)
    values: torch.Tensor = None


def init_knorm_state(n_sink, budget, D, recent=0, keep="low"):
    if keep not in ("low", "high"):
        raise ValueError(keep)
    if n_sink + recent >= budget:
        raise ValueError("n_sink + recent must be < budget")
    return KnormState(n_sink, budget, keep)


def knorm_update(st: KnormState, k, v):
    keys = k if st.keys is None else torch.cat([st.keys, k], dim=0)
    values = v if st.values is None else torch.cat([st.values, v], dim=0)
    n = keys.shape[0]
    if n > st.budget:
        norms = keys.float().norm(dim=-1)
        cand = torch.arange(st.n_sink, n)
        score = norms[st.n_sink:] if st.keep == "low" else -norms[st.n_sink:]
        chosen = cand[torch.topk(-score, st.budget - st.n_sink).indices]
        keep_idx = torch.cat([torch.arange(st.n_sink), chosen.sort().values])  # temporal order
        keys, values = keys[keep_idx], values[keep_idx]
    return KnormState(st.n_sink, st.budget, st.keep, keys, values)


def knorm_get_kv(st):
    return st.keys, st.values


# ---------------------------------------------------------------- veloxquant_mlx/cache/knorm_cache.py
@dataclass
class KVCacheConfig:
    knorm_budget: int = 16
    knorm_n_sink: int = 4
    knorm_recent: int = 0
    knorm_keep: str = "low"


class L2NormKVCache(KVCache):
    def __init__(self, config):
        super().__init__()
        self._budget = int(getattr(config, "knorm_budget", 512))
        self._n_sink = int(getattr(config, "knorm_n_sink", 4))
        self._recent = int(getattr(config, "knorm_recent", 0))
        self._keep = str(getattr(config, "knorm_keep", "low"))
        init_knorm_state(self._n_sink, self._budget, 1, recent=self._recent, keep=self._keep)
        self._states = []
        self._B = self._H = 0
        self._true_offset = 0

    def _ensure_states(self, B, H, D):
        if not self._states:
            self._B, self._H = B, H
            self._states = [
                init_knorm_state(self._n_sink, self._budget, D, recent=self._recent, keep=self._keep)
                for _ in range(B * H)
            ]

    def update_and_fetch(self, keys, values):
        B, H, S, D = keys.shape
        self._ensure_states(B, H, D)
        k_out_b, v_out_b = [], []
        for b in range(B):
            k_out_h, v_out_h = [], []
            for h in range(H):
                idx = b * self._H + h
                st = knorm_update(self._states[idx], keys[b, h].half(), values[b, h].half())
                self._states[idx] = st
                k_h, v_h = knorm_get_kv(st)
                k_out_h.append(k_h)
                v_out_h.append(v_h)
            k_out_b.append(torch.stack(k_out_h, dim=0))
            v_out_b.append(torch.stack(v_out_h, dim=0))
        K_out = torch.stack(k_out_b, dim=0).float()
        V_out = torch.stack(v_out_b, dim=0).float()

        # K_out/V_out is the full retained state every call: reset the base buffer.
        self.keys = None
        self.values = None
        self.offset = 0
        out = super().update_and_fetch(K_out, V_out)
        if FIXED:
            self._true_offset += S
            self.offset = self._true_offset
        return out


# ---------------------------------------------------------------- mlx_lm generate (greedy)
@torch.no_grad()
def generate_step(prompt, model, prompt_cache, max_tokens):
    logits = model(prompt[None], cache=prompt_cache)
    y = int(logits[0, -1].argmax())
    out, lps = [], []
    for _ in range(max_tokens):
        out.append(y)
        logits = model(torch.tensor([[y]]), cache=prompt_cache)
        lp = logits[0, -1] - torch.logsumexp(logits[0, -1], dim=-1)
        lps.append(float(lp.max()))
        y = int(lp.argmax())
    return out, lps


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = Model(args).eval()
    config = KVCacheConfig(knorm_budget=16, knorm_n_sink=4)
    cache = [L2NormKVCache(config) for _ in model.layers]

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, args.vocab_size, (12,), generator=g)
    out, lps = generate_step(prompt, model, cache, max_tokens=16)
    print("generated:", out)
    print("logprobs :", [round(x, 4) for x in lps])
    print("cache offset:", cache[0].offset, "kept rows:", cache[0].keys.shape[2])


if __name__ == "__main__":
    main()
