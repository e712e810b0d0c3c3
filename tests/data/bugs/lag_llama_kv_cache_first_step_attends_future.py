"""Lag-Llama: with ``use_kv_cache`` the first (full-context) forward ran non-causal attention.

Citation: time-series-foundation-models/lag-llama#81 ("Broken kv_cache and fixes"), fixed by PR #84
(merged). Both threads' descriptions were read, and the before/after ``CausalSelfAttention.forward`` of
``lag_llama/model/module.py`` were read from stored copies of the repository.

Bug: Lag-Llama (a nanoGPT / lit-llama style decoder ported to time series) chose the SDPA call with
``if use_kv_cache: ... is_causal=False``. The comment reasoned that a one-token decode step needs no causal
mask, which is right once the cache holds the context; but the *first* call of a cached forecast pushes the
whole context window (T > 1) through the same branch, so every context step attended to later steps, and
those non-causal keys/values were what the cache then kept.

Fix (PR #84): remember ``cache_initialized = self.kv_cache is not None`` before building the cache and use
``is_causal=False`` only when ``use_kv_cache and cache_initialized``; the first call is causal.
(PR #84 also fixed cache reset and rotary positions; this program uses the config's ``"nope"`` rope and a
fresh model, so only the attention line differs between the two runs.)

Reproduction: a 2-layer model from ``LTSMConfig`` forecasts 3 steps greedily with ``use_kv_cache=True``
over a context of 8 steps (the prefill), then 2 one-step decodes on the sliding cache.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class LTSMConfig:
    feature_size: int = 3 + 6  # target + loc + scale + time features
    block_size: int = 2048
    n_layer: int = 32
    n_head: int = 32
    n_embd_per_head: int = 128
    rope_scaling: Optional[dict] = None
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        n_embd = config.n_embd_per_head * config.n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.kv_proj = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = config.n_head
        self.n_embd_per_head = config.n_embd_per_head
        self.block_size = config.block_size
        self.dropout = config.dropout
        self.rope_scaling = config.rope_scaling
        if self.rope_scaling is not None and self.rope_scaling["type"] == "nope":
            self.rotary_emb = None
        else:
            raise ValueError("this reproduction only builds the 'nope' rope_scaling")
        self.kv_cache = None

    def forward(self, x: torch.Tensor, use_kv_cache: bool) -> torch.Tensor:
        # sequence length will be 1 when using kv_cache and kv_cache has been initialised
        (B, T, C) = x.size()
        q = self.q_proj(x)
        k, v = self.kv_proj(x).split(self.n_embd_per_head * self.n_head, dim=2)

        cache_initialized = self.kv_cache is not None
        if use_kv_cache:
            # Optimized for single next prediction
            if cache_initialized:
                # Update cache
                k = torch.cat([self.kv_cache[0], k], dim=1)[:, 1:]
                v = torch.cat([self.kv_cache[1], v], dim=1)[:, 1:]
                self.kv_cache = k, v
            else:
                # Build cache
                self.kv_cache = k, v

        k = k.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)
        q = q.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)
        v = v.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)

        # When using kv cache at inference, is_causal=False since decoder is causal, at each generation step we want
        # to avoid recalculating the same previous token attention
        if FIXED:
            use_non_causal = use_kv_cache and cache_initialized
        else:
            use_non_causal = use_kv_cache
        if use_non_causal:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=False
            )
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=True
            )

        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        n_embd = config.n_embd_per_head * config.n_head
        self.c_fc1 = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_fc2 = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        n_embd = config.n_embd_per_head * config.n_head
        self.rms_1 = nn.RMSNorm(n_embd)
        self.attn = CausalSelfAttention(config)
        self.rms_2 = nn.RMSNorm(n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, use_kv_cache: bool) -> torch.Tensor:
        x = x + self.attn(self.rms_1(x), use_kv_cache)
        return x + self.mlp(self.rms_2(x))


class LagLlamaModel(nn.Module):
    def __init__(self, config: LTSMConfig, context_length: int) -> None:
        super().__init__()
        self.context_length = context_length
        n_embd = config.n_embd_per_head * config.n_head
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Linear(config.feature_size, n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.RMSNorm(n_embd),
        ))
        self.head = nn.Linear(n_embd, config.feature_size)
        self.y_cache = False

    def reset_cache(self) -> None:
        self.y_cache = False
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def forward(self, inputs: torch.Tensor, use_kv_cache: bool = False) -> torch.Tensor:
        if use_kv_cache and self.y_cache:
            inputs = inputs[:, -1:]  # only the newest step once the cache holds the context
        x = self.transformer.wte(inputs)
        for block in self.transformer.h:
            x = block(x, use_kv_cache)
        if use_kv_cache:
            self.y_cache = True
        return self.head(self.transformer.ln_f(x))


def main() -> None:
    torch.manual_seed(0)
    config = LTSMConfig(feature_size=9, block_size=32, n_layer=2, n_head=2, n_embd_per_head=8,
                        rope_scaling={"type": "nope", "factor": 1.0})
    model = LagLlamaModel(config, context_length=8).eval()
    series = torch.randn(2, model.context_length, config.feature_size)
    model.reset_cache()
    with torch.no_grad():
        for _ in range(3):
            out = model(series, use_kv_cache=True)
            series = torch.cat([series[:, 1:], out[:, -1:]], dim=1)
    print("forecast last step:", [round(v, 4) for v in series[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
