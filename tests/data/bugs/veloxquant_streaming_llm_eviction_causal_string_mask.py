"""VeloxQuant-MLX eviction caches: the ``"causal"`` mask string meets a cache that evicted inside the call.

Citation: rajveer43/VeloxQuant-MLX#370 (issue, "eviction-family caches: eviction corrupts attention output
when triggered (mask="causal" shortcut mismatches query/key length)") fixed by rajveer43/VeloxQuant-MLX#392.
(Not #463, the later N == 1 window fix.)

Bug: every eviction cache (snapkv, streaming_llm, h2o, ...) inherited mlx-lm's ``KVCache.make_mask``, which
returns the string ``"causal"`` for a multi-token step.  mlx-lm builds that mask from the hidden states
before the projections, i.e. before the cache's ``update_and_fetch`` evicts; the cache then returned only
its kept rows, and ``mx.fast.scaled_dot_product_attention`` accepted ``"causal"`` with fewer keys than
queries, applying a lower-right-aligned causal mask: query i saw kept row j iff j <= i - (L - kept), a
mapping that is wrong as soon as eviction drops rows that are not at the front.

Fix (#392): ``update_and_fetch`` defers eviction past its own return -- it returns the full un-evicted
concatenation (what was stored before ++ this call's tokens), matching the mask already built for the call,
and evicts afterwards for later steps.

This program is a torch port of a StreamingLLM (sink + recent) cache under an mlx-lm style Llama:
``"causal"`` becomes ``torch.nn.attention.bias.causal_lower_right(L, S)`` (MLX's alignment) handed to
``F.scaled_dot_product_attention``.  Budget 8 (2 sinks + 6 recent) and a 12-token prompt: buggy, the
prompt's queries see 8 kept keys through a lower-right triangle; fixed, all 12 keys causally.  Two decode
steps follow.  The issue and PR descriptions were read, not the diff.
"""
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

FIXED = "--fixed" in sys.argv
# torch warns that a lower-right triangle with more queries than keys leaves rows empty: that is the bug
warnings.filterwarnings("ignore", message="Lower right causal bias")


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

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if N == 1:
            return None
        return "causal"


class StreamingLLMKVCache(KVCache):
    """Attention sinks + a recent window: keeps ``n_sink`` first rows and the newest ``budget - n_sink``."""

    def __init__(self, budget: int = 8, n_sink: int = 2):
        super().__init__()
        self.budget = budget
        self.n_sink = n_sink

    def _evict(self):
        if self.keys.shape[2] <= self.budget:
            return
        recent = self.budget - self.n_sink
        self.keys = torch.cat([self.keys[:, :, : self.n_sink], self.keys[:, :, -recent:]], dim=2)
        self.values = torch.cat([self.values[:, :, : self.n_sink], self.values[:, :, -recent:]], dim=2)

    def update_and_fetch(self, keys, values):
        if FIXED:
            full_k, full_v = super().update_and_fetch(keys, values)
            # evict after returning the whole concatenation: the mask of this call was built for it
            self._evict()
            return full_k, full_v
        super().update_and_fetch(keys, values)
        self._evict()
        return self.keys, self.values


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    return "causal"


def scaled_dot_product_attention(queries, keys, values, scale, mask):
    if isinstance(mask, str) and mask == "causal":
        # mx.fast.scaled_dot_product_attention aligns "causal" to the bottom right
        mask = causal_lower_right(queries.shape[2], keys.shape[2])
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class Attention(nn.Module):
    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.scale = (dim // n_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


class TransformerBlock(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.self_attn = Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.input_layernorm = nn.LayerNorm(dim)
        self.post_attention_layernorm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, vocab=64, dim=32, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.lm_head(self.norm(h))


def main():
    torch.manual_seed(0)
    model = LlamaModel().eval()
    cache = [StreamingLLMKVCache(budget=8, n_sink=2) for _ in model.layers]
    prompt = torch.randint(1, 64, (1, 12))
    out = []
    with torch.no_grad():
        y = model(prompt, cache=cache)[:, -1].argmax(-1)
        out.append(y.item())
        for _ in range(2):
            y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
            out.append(y.item())
    print(f"{'fixed' if FIXED else 'buggy'} tokens {out}")


if __name__ == "__main__":
    main()
