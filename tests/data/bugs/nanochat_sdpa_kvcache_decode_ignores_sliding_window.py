"""nanochat: the SDPA fallback of flash_attn_with_kvcache ignores the sliding window while decoding.

Citation: karpathy/nanochat issue #452 ("Flash Attention Fallback - Missing sliding window in
`flash_attn_with_kvcache`?"), fixed by PR #456, merged as commit 3ba42e8135bc88283004fc8d803a1eb00879a738
("Fix SDPA KV-cache decode to respect sliding window"). Pre-fix and fixed `nanochat/flash_attention.py`
and `nanochat/gpt.py` / `nanochat/engine.py` were read in the upstream repository.

Bug: `GPTConfig.window_pattern` gives "S" layers a window of `sequence_len // 2` (FA3 `window_size=(N, 0)`).
On machines without FA3, `_sdpa_attention` handles it for training, but during KV-cache inference
the single-token branch `if Tq == 1: return F.scaled_dot_product_attention(q, k, v, is_causal=False)`
attends the whole cache, and the chunk-prefill branch (Tq != Tk) builds "all prefix + causal chunk"
without the window. So short-window layers see every cached token once the context exceeds the window.

Fix: for Tq == 1 slice K/V to the last `window + 1` keys; for chunks build the mask from absolute
row/col indices `row = (Tk - Tq) + arange(Tq)` and AND it with `(row - col) <= window`.

Reproduction: a tiny nanochat-style GPT (window_pattern "SL", sequence_len 16 -> short window 8) with
the engine's pre-allocated KVCache; prefill 6 tokens, then a chunk of 5, then 6 single-token decode
steps, all through the SDPA fallback (no FA3 on CPU). The "S" layer's decode queries at positions
>= 9 attend keys older than the window before the fix.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- nanochat/flash_attention.py (SDPA fallback) ----
def _sdpa_attention(q, k, v, window_size, enable_gqa):
    """SDPA attention with sliding window support. q, k, v are (B, H, T, D) format."""
    Tq = q.size(2)
    Tk = k.size(2)
    window = window_size[0]

    # Full context, same length
    if (window < 0 or window >= Tq) and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)

    # Single token generation
    if Tq == 1:
        if FIXED and window >= 0 and window < Tk:
            # window is "left" tokens we need to include (window + 1) keys total
            start = max(0, Tk - (window + 1))
            k = k[:, :, start:, :]
            v = v[:, :, start:, :]
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)

    device = q.device
    if FIXED:
        # For chunk inference (Tq != Tk), is_causal is not aligned to cache position => explicit bool mask
        row_idx = (Tk - Tq) + torch.arange(Tq, device=device).unsqueeze(1)
        col_idx = torch.arange(Tk, device=device).unsqueeze(0)
        mask = col_idx <= row_idx
        if window >= 0 and window < Tk:
            mask = mask & ((row_idx - col_idx) <= window)
    elif Tq == Tk:
        # Causal + sliding window
        mask = torch.tril(torch.ones(Tq, Tk, device=device, dtype=torch.bool))
        if window > 0 and window < Tq:
            row_idx = torch.arange(Tq, device=device).unsqueeze(1)
            col_idx = torch.arange(Tk, device=device).unsqueeze(0)
            mask = mask & ((row_idx - col_idx) <= window)
    else:
        # Chunk inference: attend to prefix + causal within chunk
        prefix_len = Tk - Tq
        mask = torch.zeros(Tq, Tk, device=device, dtype=torch.bool)
        mask[:, :prefix_len] = True
        mask[:, prefix_len:] = torch.tril(torch.ones(Tq, Tq, device=device, dtype=torch.bool))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            causal=False, window_size=(-1, -1)):
    """SDPA fallback: manually manage the KV cache (FA3 updates it in place, so do we)."""
    B, T_new, H, D = q.shape
    pos = cache_seqlens[0].item()  # assume uniform position across batch
    if k is not None and v is not None:
        k_cache[:, pos:pos + T_new, :, :] = k
        v_cache[:, pos:pos + T_new, :, :] = v
    end_pos = pos + T_new
    q_sdpa = q.transpose(1, 2)
    k_sdpa = k_cache[:, :end_pos].transpose(1, 2)
    v_sdpa = v_cache[:, :end_pos].transpose(1, 2)
    enable_gqa = q_sdpa.size(1) != k_sdpa.size(1)
    return _sdpa_attention(q_sdpa, k_sdpa, v_sdpa, window_size, enable_gqa).transpose(1, 2)


# ---- nanochat/engine.py ----
class KVCache:
    """KV Cache for flash_attn_with_kvcache: (n_layers, B, T, H, D), position per batch element."""

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device, dtype):
        self.n_layers = num_layers
        self.k_cache = torch.zeros(num_layers, batch_size, seq_len, num_heads, head_dim, device=device, dtype=dtype)
        self.v_cache = torch.zeros(num_layers, batch_size, seq_len, num_heads, head_dim, device=device, dtype=dtype)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)

    def get_layer_cache(self, layer_idx):
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, num_tokens):
        self.cache_seqlens += num_tokens


# ---- nanochat/gpt.py ----
@dataclass
class GPTConfig:
    sequence_len: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4  # number of query heads
    n_kv_head: int = 2  # number of key/value heads (GQA)
    n_embd: int = 32
    # Sliding window attention pattern string, tiled across layers. Final layer always L.
    window_pattern: str = "SL"


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos_sin, window_size, kv_cache):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)  # QK norm
        k_cache, v_cache = kv_cache.get_layer_cache(self.layer_idx)
        y = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=kv_cache.cache_seqlens,
                                   causal=True, window_size=window_size)
        if self.layer_idx == kv_cache.n_layers - 1:
            kv_cache.advance(T)
        return self.c_proj(y.contiguous().view(B, T, -1))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([CausalSelfAttention(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.window_sizes = self._compute_window_sizes(config)
        head_dim = config.n_embd // config.n_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(config.sequence_len * 10).float(), inv_freq)
        self.cos, self.sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def _compute_window_sizes(self, config):
        pattern = config.window_pattern.upper()
        long_window = config.sequence_len
        short_window = long_window // 2
        char_to_window = {"L": (long_window, 0), "S": (short_window, 0)}
        window_sizes = [char_to_window[pattern[i % len(pattern)]] for i in range(config.n_layer)]
        window_sizes[-1] = (long_window, 0)
        return window_sizes

    def forward(self, idx, kv_cache):
        B, T = idx.size()
        T0 = kv_cache.cache_seqlens[0].item()
        cos_sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        x = norm(self.wte(idx))
        for i, block in enumerate(self.h):
            x = x + block(norm(x), cos_sin, self.window_sizes[i], kv_cache)
        return self.lm_head(norm(x))


def main():
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config).eval()
    kv_cache = KVCache(1, config.n_kv_head, config.sequence_len, config.n_embd // config.n_head,
                       config.n_layer, "cpu", torch.float32)
    prompt = torch.randint(0, config.vocab_size, (1, 11))
    generated = []
    with torch.no_grad():
        model(prompt[:, :6], kv_cache)  # prefill
        logits = model(prompt[:, 6:], kv_cache)  # chunked prefill over the cached prefix
        for _ in range(5):  # decode steps, one token each
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(nxt.item())
            logits = model(nxt, kv_cache)
    print("window_sizes", model.window_sizes, "generated", generated,
          "last logit sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
