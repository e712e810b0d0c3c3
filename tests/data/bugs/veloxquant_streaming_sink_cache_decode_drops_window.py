"""VeloxQuant-MLX: the eviction-cache mask drops the sliding window on single-token decode steps.

Citation: rajveer43/VeloxQuant-MLX PR #463 ("fix(cache): don't drop window_size bound at N==1 in
eviction mask", merged; description read). Context: issue #370 (eviction caches and the "causal"
shortcut). The upstream code is MLX; this is a torch port written from the PR description and the
mlx_lm `create_attention_mask` / `cache.make_mask` protocol it names (function and class names are
the project's; bodies reconstructed, not copied, because the source could not be fetched here).

Bug: `eviction_make_mask()` returns `None` whenever `N == 1`. For a sink+window cache
(`StreamingLLMKVCache`) the retained keys are the sink rows plus the most recent rows, so with no mask
a decode query of a sliding-window layer attends every retained key, including sinks and recent rows
that are already older than the model's `sliding_window`, although `create_attention_mask()` passed
`window_size` down to `cache.make_mask()`.

Fix: take the `N == 1` shortcut only when `window_size is None`; otherwise build the explicit boolean
mask from the retained `key_positions`: `key_positions[j] <= query_positions[i] < key_positions[j] + window_size`.

Reproduction: a two-layer sliding-window model (`ModelArgs.sliding_window = 5`) with a
StreamingLLMKVCache of 2 sinks + 8 recent keys; prompt of 12 tokens, then 4 decode steps. Attention is
`F.scaled_dot_product_attention` (the port of `mx.fast.scaled_dot_product_attention`).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def eviction_make_mask(N, query_offset, key_positions, window_size=None):
    """Mask for caches whose retained key positions are not one contiguous range (True = attend)."""
    if N == 1 and (not FIXED or window_size is None):
        return None
    query_positions = torch.arange(query_offset, query_offset + N)[:, None]
    kp = key_positions[None, :]
    mask = kp <= query_positions
    if window_size is not None:
        mask = mask & (query_positions < kp + window_size)
    return mask


class StreamingLLMKVCache:
    """Keeps the first `n_sink` keys forever plus the most recent `window` keys (StreamingLLM)."""

    def __init__(self, n_sink=2, window=8):
        self.n_sink, self.window = n_sink, window
        self.keys = self.values = None
        self.key_positions = torch.empty(0, dtype=torch.long)
        self.offset = 0

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        pos = torch.arange(self.offset, self.offset + n)
        if self.keys is None:
            self.keys, self.values, self.key_positions = keys, values, pos
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.key_positions = torch.cat([self.key_positions, pos])
        self.offset += n
        k, v = self.keys, self.values
        # Evict the middle after this step's attention has seen the full prompt.
        if self.keys.shape[2] > self.n_sink + self.window:
            keep = torch.cat([torch.arange(self.n_sink),
                              torch.arange(self.keys.shape[2] - self.window, self.keys.shape[2])])
            self.keys, self.values = self.keys[:, :, keep], self.values[:, :, keep]
            self.key_positions = self.key_positions[keep]
        return k, v

    def make_mask(self, N, return_array=False, window_size=None):
        # key positions this step will see = retained + the N new ones
        kp = torch.cat([self.key_positions, torch.arange(self.offset, self.offset + N)])
        return eviction_make_mask(N, self.offset, kp, window_size=window_size)


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    return "causal"


@dataclass
class ModelArgs:
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 50
    sliding_window: int = 5


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if isinstance(mask, str):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([Attention(args) for _ in range(args.num_hidden_layers)])
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache):
        h = self.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0], window_size=self.args.sliding_window)
        for layer, c in zip(self.layers, cache):
            h = h + layer(F.rms_norm(h, (h.shape[-1],)), mask, c)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    model = Model(ModelArgs()).eval()
    cache = [StreamingLLMKVCache(n_sink=2, window=8) for _ in model.layers]
    prompt = torch.randint(0, 50, (1, 12))
    out = []
    with torch.no_grad():
        logits = model(prompt, cache)
        for _ in range(4):
            tok = logits[:, -1:].argmax(-1)
            out.append(tok.item())
            logits = model(tok, cache)
    print("retained key positions", cache[0].key_positions.tolist(), "generated", out,
          "last logit sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
