"""VeloxQuant-MLX's TOVA-adapted KV cache under mlx_lm's Llama attention, ported from MLX to torch at tiny sizes.

Citation: rajveer43/VeloxQuant-MLX#196 ("fix(cache): generalize RoPE offset fix to TOVA cache; audit H2O",
merged; follow-up of issue #175 and of the Q-Filters fix #171). veloxquant_mlx/cache/tova_cache.py,
TOVAKVCache.update_and_fetch.

Bug: mlx_lm's attention rotates the new queries and keys at ``offset=cache.offset`` before it calls
``cache.update_and_fetch``. TOVAKVCache.update_and_fetch ran the TOVA eviction, then reset ``self.offset = 0`` and
handed the kept rows to the base KVCache.update_and_fetch, which set ``offset`` back to the number of kept rows. Once
the cache is pinned at ``tova_budget`` every later token is rotated at position ``tova_budget`` instead of its own.
Fix: keep a ``_true_offset`` counter, advanced by the incoming block size, and report it as ``self.offset`` (the kept
rows stay in temporal order, so survivors need no re-rotation).
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- mlx_lm.models.cache.KVCache (torch port)
class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys[..., : self.offset, :], keys], dim=2)
            self.values = torch.cat([self.values[..., : self.offset, :], values], dim=2)
        self.offset += keys.shape[2]
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


# ---------------------------------------------------------------- veloxquant_mlx/quantizers/tova.py (per head)
@dataclass
class TovaState:
    keys: torch.Tensor
    values: torch.Tensor
    n_sink: int
    budget: int


def init_tova_state(n_sink, budget, head_dim):
    return TovaState(None, None, n_sink, budget)


def tova_update(state, k_new, v_new):
    """Append tokens one at a time; whenever the cache exceeds the budget, drop the non-sink row
    with the lowest current-step attention weight (the new key stands in for the query)."""
    K, V = state.keys, state.values
    for t in range(k_new.shape[0]):
        kt, vt = k_new[t : t + 1], v_new[t : t + 1]
        K = kt if K is None else torch.cat([K, kt], dim=0)
        V = vt if V is None else torch.cat([V, vt], dim=0)
        if K.shape[0] > state.budget:
            w = torch.softmax((kt.float() @ K.float().T) / math.sqrt(K.shape[-1]), dim=-1)[0]
            w[: state.n_sink] = float("inf")
            drop = int(torch.argmin(w))
            keep = [i for i in range(K.shape[0]) if i != drop]
            K, V = K[keep], V[keep]
    return TovaState(K, V, state.n_sink, state.budget)


# ---------------------------------------------------------------- veloxquant_mlx/cache/tova_cache.py
@dataclass
class KVCacheConfig:
    method: str = "tova"
    head_dim: int = 8
    tova_budget: int = 8
    tova_n_sink: int = 2


class TOVAKVCache(KVCache):
    def __init__(self, config):
        super().__init__()
        self._budget = int(getattr(config, "tova_budget", 512))
        self._n_sink = int(getattr(config, "tova_n_sink", 4))
        self._states = []
        self._B = self._H = self._head_dim = 0
        self._true_offset = 0

    def _ensure_states(self, B, H, D):
        if not self._states:
            self._B, self._H, self._head_dim = B, H, D
            self._states = [init_tova_state(self._n_sink, self._budget, D) for _ in range(B * H)]

    def _head_idx(self, b, h):
        return b * self._H + h

    def update_and_fetch(self, keys, values):
        B, H, S, D = keys.shape
        self._ensure_states(B, H, D)
        for b in range(B):
            for h in range(H):
                i = self._head_idx(b, h)
                self._states[i] = tova_update(self._states[i], keys[b, h], values[b, h])
        K_out = torch.stack([torch.stack([self._states[self._head_idx(b, h)].keys for h in range(H)]) for b in range(B)])
        V_out = torch.stack([torch.stack([self._states[self._head_idx(b, h)].values for h in range(H)]) for b in range(B)])
        if FIXED:
            self.keys, self.values = K_out, V_out
            self._true_offset += S
            self.offset = self._true_offset
            return self.keys, self.values
        # write the retained window through to the base cache
        self.offset = 0
        self.keys = None
        self.values = None
        return super().update_and_fetch(K_out, V_out)


# ---------------------------------------------------------------- mlx_lm/models/llama.py (torch port)
@dataclass
class ModelArgs:
    model_type: str = "llama"
    hidden_size: int = 32
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    vocab_size: int = 64
    rope_theta: float = 10000.0


class RoPE(nn.Module):
    """mlx.nn.RoPE(dims, traditional=False, base): positions offset .. offset + L - 1."""

    def __init__(self, dims, base):
        super().__init__()
        self.dims, self.base = dims, base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        half = self.dims // 2
        inv = self.base ** (-torch.arange(half, dtype=torch.float32) / half)
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        theta = pos[:, None] * inv[None, :]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def create_attention_mask(h, cache=None):
    T = h.shape[1]
    if T > 1:
        return "causal"
    return None


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.rope = RoPE(self.head_dim, args.rope_theta)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
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
            queries, keys, values, scale=self.scale, is_causal=(mask == "causal"), enable_gqa=True
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

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
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.lm_head(self.norm(h))


# ---------------------------------------------------------------- KVCacheBuilder.for_model + greedy generate
def make_cache(model, config):
    return [TOVAKVCache(config) for _ in model.layers]


@torch.no_grad()
def generate(model, prompt, cache, max_tokens):
    logits = model(prompt[None], cache=cache)
    y = logits[:, -1].argmax(-1)
    tokens, last_logits = [int(y)], [logits[0, -1]]
    for _ in range(max_tokens - 1):
        logits = model(y[:, None], cache=cache)
        y = logits[:, -1].argmax(-1)
        tokens.append(int(y))
        last_logits.append(logits[0, -1])
    return tokens, torch.stack(last_logits)


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = Model(args).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    config = KVCacheConfig(head_dim=args.hidden_size // args.num_attention_heads, tova_budget=8, tova_n_sink=2)
    cache = make_cache(model, config)
    prompt = torch.tensor([3, 17, 42, 8, 25, 11])
    tokens, logits = generate(model, prompt, cache, max_tokens=14)
    print("generated:", tokens)
    print("kept rows:", cache[0].keys.shape[2], "cache offset:", cache[0].offset)
    print("last-step logits[:6]:", [round(v, 4) for v in logits[-1, :6].tolist()])
    print("logit checksum:", round(float(logits.abs().sum()), 4))


if __name__ == "__main__":
    main()
