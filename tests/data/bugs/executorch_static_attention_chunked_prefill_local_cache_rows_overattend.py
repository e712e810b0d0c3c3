"""ExecuTorch static attention: chunked prefill lets every query row of a sliding-window layer see
the whole (shift_pointer) cache, so row k attends cache_len + k + 1 keys instead of cache_len.

Citation: pytorch/executorch PR #21857 ("Fix sliding-window over-attention in chunked prefill"),
commit 3caaaca1fa, in examples/models/llama/static_attention.py (diff read).

Bug: `StaticAttentionMask.unmask` opens the cache region of the mask identically for every query
row, and `StaticAttentionIOManager.prefill` / `decode` leave it that way. For a local layer (a
per-layer `cache_len` smaller than the global cache) the shift_pointer ring already holds the
last `cache_len` tokens, so query row k of a chunk sees all of them plus k + 1 in-chunk keys: more
than its window. Multi-chunk prefill then differs from single-chunk prefill.

Fix: `_mask_cache_outside_window()` runs before every `_run_once` (prefill chunks and decode
steps) and rewrites the cache columns of each windowed mask per row: with W = cache_len and
v = min(pos, W) valid entries, cache column c is visible to row k iff c >= max(W - v, k + 1).
The same commit clamps the slice end of `unmask` (shift_pointer) at 0; that part is carried too.

Reproduction: a 2-layer llama-like model written as ExecuTorch's StaticAttention (keys are the
cache concatenated with the new keys, an additive mask picked by cache_len, softmax over
q @ k^T). Layer 0 is global (cache_len 16), layer 1 local (cache_len 3). input_len 2: an
8-token prompt is prefilled in 4 chunks, then 3 tokens are decoded.
"""
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    hidden_dim: int = 64
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def cache_key(layer_id, head_id):
    return f"l{layer_id},h{head_id}"


def apply_update(cache, update, pos, style, update_pos=0, update_len=None):
    """StaticKVCache.apply_update (non-transposed): what the runtime does after each run."""
    cache_len = cache.size(-2)
    if cache_len == 0:
        return cache
    if cache_len < update.size(-2):
        update = torch.narrow(update, -2, update.size(-2) - cache_len, cache_len)
    assert style == "shift_pointer"
    update_len = update_len or update.size(-2)
    updated = torch.roll(cache, -update_len, -2)
    updated[..., -update_len:, :] = update[..., update_pos : update_pos + update_len, :]
    return updated


class StaticAttentionMask:
    def __init__(self, input_len, cache_len, style, mask_val=float("-inf"), dtype=torch.float32):
        self.input_len = input_len
        self.cache_len = cache_len
        self.style = style
        self.mask_val = mask_val
        self.unmasked_len = 0
        self.tensor = torch.zeros(1, input_len, input_len + cache_len, dtype=dtype)
        self.reset()

    def reset(self):
        self.unmasked_len = 0
        self.tensor[:, :, : self.cache_len] = self.mask_val

    def set_input_mask(self, input_mask):
        self.tensor[:, :, self.cache_len :] = input_mask

    def unmask(self, new_unmasked_len):
        if new_unmasked_len <= 0:
            return
        start = max(0, self.cache_len - self.unmasked_len - new_unmasked_len)
        end = self.cache_len - self.unmasked_len
        if FIXED:
            end = max(0, end)
        self.tensor[:, :, start:end] = 0
        self.unmasked_len += new_unmasked_len


def precompute_freqs(head_dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(end).float(), freqs)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class StaticAttention(nn.Module):
    def __init__(self, config: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.n_heads_per_kv_group = self.n_heads // self.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.inv_scale = 1.0 / self.head_dim ** 0.5
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def _compute_attention(self, q, k, v, mask):
        attn = q @ k.transpose(-2, -1)
        attn = attn * self.inv_scale
        attn = attn + mask
        attn = F.softmax(attn, dim=-1)
        return attn @ v

    def forward(self, x, freqs_cos, freqs_sin, masks, in_cache_state, out_cache_state):
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, freqs_cos, freqs_sin)
        k = apply_rope(k, freqs_cos, freqs_sin)
        key = cache_key(self.layer_id, 0)
        all_k = torch.cat([in_cache_state[0][key], k], dim=-2)
        all_v = torch.cat([in_cache_state[1][key], v], dim=-2)
        out_cache_state[0][key] = k
        out_cache_state[1][key] = v
        cache_len = all_k.size(-2) - seq_len
        mask = masks[cache_len]
        all_k = all_k.repeat_interleave(self.n_heads_per_kv_group, dim=1)
        all_v = all_v.repeat_interleave(self.n_heads_per_kv_group, dim=1)
        y = self._compute_attention(q, all_k, all_v, mask)
        return self.wo(y.transpose(1, 2).reshape(bsz, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = StaticAttention(config, layer_id)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = nn.Sequential(nn.Linear(config.dim, config.hidden_dim), nn.SiLU(),
                                          nn.Linear(config.hidden_dim, config.dim))

    def forward(self, x, *args):
        x = x + self.attention(self.attention_norm(x), *args)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens, attn_options):
        h = self.tok_embeddings(tokens)
        out_cache_state = ({}, {})
        for layer in self.layers:
            h = layer(h, attn_options["freqs_cos_override"], attn_options["freqs_sin_override"],
                      attn_options["masks"], attn_options["in_cache_state"], out_cache_state)
        return self.output(self.norm(h)), {"out_cache_state": out_cache_state}


class StaticAttentionIOManager:
    def __init__(self, config: ModelArgs, input_len: int, cache_lens: List[int],
                 style: str = "shift_pointer", mask_val: float = float("-inf")):
        cache_lens_dict = dict(enumerate(cache_lens))
        self._masks = {cl: StaticAttentionMask(input_len, cl, style=style, mask_val=mask_val)
                       for cl in set(cache_lens)}
        # Global (full-attention) layers use the largest cache; local (sliding-window) layers
        # use a strictly smaller cache.
        self._global_cache_len = max((m.cache_len for m in self._masks.values()), default=0)
        head_dim = config.dim // config.n_heads
        self.k_caches = {cache_key(i, 0): torch.zeros(1, config.n_kv_heads, cache_lens_dict[i], head_dim)
                         for i in range(config.n_layers)}
        self.v_caches = {k: torch.zeros_like(v) for k, v in self.k_caches.items()}
        self.freqs_cos, self.freqs_sin = precompute_freqs(head_dim, config.max_seq_len, config.rope_theta)
        self.input_len = input_len
        self.style = style
        self.mask_val = mask_val
        self.pos = 0

    @property
    def masks(self):
        return {cache_len: mask.tensor for cache_len, mask in self._masks.items()}

    def _is_windowed_mask(self, mask):
        return 0 < mask.cache_len < self._global_cache_len

    def _mask_cache_outside_window(self):
        # The fix: per-row cache visibility for local layers (shift_pointer: valid entries are
        # right aligned, oldest to newest).
        for mask in self._masks.values():
            if not self._is_windowed_mask(mask):
                continue
            w = mask.cache_len
            first_valid = w - min(self.pos, w)
            rows = torch.arange(self.input_len).unsqueeze(1)
            cols = torch.arange(w).unsqueeze(0)
            visible = cols >= torch.clamp(rows + 1, min=first_valid)
            cache_mask = torch.full((self.input_len, w), mask.mask_val, dtype=mask.tensor.dtype)
            cache_mask[visible] = 0
            mask.tensor[:, :, :w] = cache_mask

    def prefill(self, model, tokens):
        for mask in self._masks.values():
            input_mask = torch.triu(torch.full((1, self.input_len, self.input_len), self.mask_val), diagonal=1)
            if self._is_windowed_mask(mask) and mask.cache_len < self.input_len:
                input_mask = input_mask + torch.tril(
                    torch.full((1, self.input_len, self.input_len), self.mask_val),
                    diagonal=-mask.cache_len)
            mask.set_input_mask(input_mask)
        logits = None
        for i in range(0, tokens.size(1), self.input_len):
            if FIXED:
                self._mask_cache_outside_window()
            logits = self._run_once(model, tokens[:, i : i + self.input_len])[0]
        return logits

    def decode(self, model, init_token, n):
        for mask in self._masks.values():
            mask.set_input_mask(torch.triu(
                torch.full((1, self.input_len, self.input_len), self.mask_val), diagonal=1))
        new_tokens = [init_token]
        for _ in range(n):
            if FIXED:
                self._mask_cache_outside_window()
            y = self._run_once(model, new_tokens[-1:])[0]
            new_tokens.append(y[:, 0].argmax().item())
        return new_tokens

    def _run_once(self, model, tokens):
        if isinstance(tokens, list):
            tokens = torch.tensor([tokens], dtype=torch.long)
        n_tokens = tokens.size(1)
        if n_tokens < self.input_len:
            tokens = F.pad(tokens, (0, self.input_len - n_tokens))
        y, attn_updates = model(tokens, {
            "masks": self.masks,
            "freqs_cos_override": self.freqs_cos[self.pos : self.pos + self.input_len],
            "freqs_sin_override": self.freqs_sin[self.pos : self.pos + self.input_len],
            "in_cache_state": (self.k_caches, self.v_caches),
        })
        self._update_states(attn_updates, 0, n_tokens)
        return y, attn_updates

    def _update_states(self, attn_updates, update_pos, update_len):
        for mask in self._masks.values():
            mask.unmask(update_len)
        k_updates, v_updates = attn_updates["out_cache_state"]
        for cache_id, update in k_updates.items():
            self.k_caches[cache_id] = apply_update(self.k_caches[cache_id], update, self.pos, self.style,
                                                   update_pos, update_len).detach()
        for cache_id, update in v_updates.items():
            self.v_caches[cache_id] = apply_update(self.v_caches[cache_id], update, self.pos, self.style,
                                                   update_pos, update_len).detach()
        self.pos += update_len


if __name__ == "__main__":
    torch.manual_seed(0)
    config = ModelArgs()
    model = Transformer(config).eval()
    # layer 0: global attention (cache 16); layer 1: local sliding window of 3 (cache 3)
    mgr = StaticAttentionIOManager(config, input_len=2, cache_lens=[16, 3])
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    with torch.no_grad():
        logits = mgr.prefill(model, prompt)
        toks = mgr.decode(model, logits[:, -1].argmax().item(), 3)
    print("fixed" if FIXED else "buggy", toks)
