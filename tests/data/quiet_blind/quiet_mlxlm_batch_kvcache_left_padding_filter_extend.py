"""Batched generation over mlx-lm's BatchKVCache, ported from MLX to torch at tiny sizes.

Ported from ml-explore/mlx-lm:
  mlx_lm/models/cache.py   BatchKVCache (left_padding, per-sequence offset = -left_padding,
                           update_and_fetch, make_mask, filter, extend)
  mlx_lm/models/base.py    create_causal_mask(N, offset, window_size, right_padding,
                           left_padding), create_attention_mask(h, cache)
                           (commit 0d3ec31943aa2834862dd6ad190ea9eeb3cd680e)
  mlx_lm/models/base.py    quantized_scaled_dot_product_attention's dense fallback:
                           bool mask -> where(mask, scores, finfo.min), softmax
  mlx_lm/models/llama.py   Attention: rope(q/k, offset=cache.offset) before update_and_fetch;
                           LlamaModel: mask = create_attention_mask(h, cache[0]) once

Prompts are LEFT-padded; each row's mask hides keys with index < left_padding and keys
after the query.  The padded query rows of the prefill have no visible key at all: the
finite finfo.min fill (not -inf) makes them a harmless uniform average instead of NaN,
and their outputs are never read.  RoPE positions come from the per-row offset, so a
row's first real token sits at position 0 whatever its padding.  Mid-generation one
sequence finishes (`filter`, which also shifts away common left padding) and a new
prompt, prefilled in its own cache, joins the batch (`extend`, which right-justifies the
shorter cache and adds the difference to its left_padding).

Check: every logit row produced for a real token equals the logits of that sequence run
alone, unpadded, with a full causal forward and no cache.
"""

import math
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------ mlx_lm/models/base.py
def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None,
                       right_padding: Optional[torch.Tensor] = None, left_padding: Optional[torch.Tensor] = None):
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


def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def scaled_dot_product_attention(queries, keys, values, scale: float, mask):
    # dense version of mlx-lm's reference path (quantized_scaled_dot_product_attention)
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if n_repeats > 1:
        queries = queries.reshape(B, n_kv_heads, n_repeats, L, D)
        keys = keys.unsqueeze(-3)
        values = values.unsqueeze(-3)
    scores = queries @ keys.transpose(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            q_indices = torch.arange(kL - qL, kL)
            k_indices = torch.arange(kL)
            mask = q_indices[:, None] >= k_indices[None]
        if n_repeats > 1 and mask.dim() == 4:
            mask = mask.unsqueeze(2)  # (B, 1, 1, L, S): broadcast over kv heads and repeats
        if mask.dtype == torch.bool:
            scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = torch.softmax(scores, dim=-1)
    out = scores @ values
    if n_repeats > 1:
        out = out.reshape(B, n_q_heads, L, D)
    return out


# ----------------------------------------------------------------- mlx_lm/models/cache.py
class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: List[int]):
        """Inputs are left-padded; ``left_padding`` is the amount of padding per row."""
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._idx = 0

    def update_and_fetch(self, keys, values):
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = torch.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), dtype=keys.dtype)
            new_v = torch.zeros((B, n_kv_heads, n_steps * self.step, v_head_dim), dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        self.keys[..., prev:self._idx, :] = keys
        self.values[..., prev:self._idx, :] = values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices):
        """In-place filter to keep just the given indices in the cache."""
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        # Shift left to reduce padding
        min_left_pad = self.left_padding.min().item()
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys = self.keys[..., min_left_pad:, :]
                self.values = self.values[..., min_left_pad:, :]
            self._idx -= min_left_pad
            self.left_padding = self.left_padding - min_left_pad

    def extend(self, other):
        """In-place extend this cache with the other cache."""
        max_idx = max(self._idx, other._idx)
        B, H, L1, D = self.keys.shape
        M = self.values.shape[3]
        L2 = other.keys.shape[2]
        max_size = max(L1, L2)

        # Pad the keys and values so they are right-justified with the index and the same size
        def pad(c):
            k, v = c.keys, c.values
            left = max_idx - c._idx
            right = max_size - k.shape[2] - left
            if right < 0:
                k = k[..., :right, :]
                v = v[..., :right, :]
                right = 0
            if left != 0 or right != 0:
                k = F.pad(k, (0, 0, left, right))
                v = F.pad(v, (0, 0, left, right))
            left_padding = c.left_padding + left
            return k, v, c.offset, left_padding

        self.keys, self.values, self.offset, self.left_padding = map(
            lambda xs: torch.cat(xs, dim=0), zip(*(pad(self), pad(other)))
        )
        self._idx = max_idx

    def size(self):
        return self._idx


# ---------------------------------------------------------------- mlx_lm/models/llama.py
def rope(x, offset, base=10000.0):
    """nn.RoPE(dims, traditional=False) with a per-row array offset: (B, H, L, D)."""
    B, H, L, D = x.shape
    if isinstance(offset, int):
        offset = torch.full((B,), offset)
    pos = offset[:, None].float() + torch.arange(L).float()[None]  # (B, L)
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    ang = pos[..., None] * inv  # (B, L, D/2)
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            queries = rope(queries, offset=cache.offset)
            keys = rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = rope(queries, offset=0)
            keys = rope(keys, offset=0)
        output = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.self_attn = Attention(dim, n_heads, n_kv_heads)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        r = self.post_attention_layernorm(h)
        return h + self.down(F.silu(self.gate(r)) * self.up(r))


class Model(nn.Module):
    def __init__(self, vocab=40, dim=32, n_heads=4, n_kv_heads=2, hidden=64, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.lm_head(self.norm(h))

    def make_batch_cache(self, left_padding):
        return [BatchKVCache(left_padding) for _ in self.layers]


def left_pad(prompts, pad_id=0):
    lengths = [len(p) for p in prompts]
    max_len = max(lengths)
    padding = [max_len - l for l in lengths]
    rows = [[pad_id] * p + list(t) for p, t in zip(padding, prompts)]
    return torch.tensor(rows), padding


# ---------------------------------------------------------------- driver + reference
@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    model = Model().eval()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.4)

    prompts = {"A": [5, 9, 13], "B": [7, 2, 30, 4, 11], "C": [21, 8]}
    late = {"D": [3, 14, 27, 6]}
    seqs = {k: list(v) for k, v in {**prompts, **late}.items()}
    logged = {k: [] for k in seqs}  # (position, logits row) for each produced row

    # prefill the first batch (left padded)
    order = ["A", "B", "C"]
    ids, padding = left_pad([prompts[k] for k in order])
    cache = model.make_batch_cache(padding)
    logits = model(ids, cache=cache)
    for b, k in enumerate(order):
        for t in range(padding[b], ids.shape[1]):
            logged[k].append((t - padding[b], logits[b, t]))
    nxt = logits[:, -1].argmax(-1)

    def decode(steps):
        nonlocal nxt
        for _ in range(steps):
            for b, k in enumerate(order):
                seqs[k].append(int(nxt[b]))
            logits = model(nxt[:, None], cache=cache)
            for b, k in enumerate(order):
                logged[k].append((len(seqs[k]) - 1, logits[b, 0]))
            nxt = logits[:, -1].argmax(-1)

    decode(4)

    # B finishes: drop it (BatchGenerator does cache.filter(keep) on every layer)
    keep = [0, 2]
    for c in cache:
        c.filter(torch.tensor(keep))
    order = [order[i] for i in keep]
    nxt = nxt[keep]
    print("after filter: left_padding", cache[0].left_padding.tolist(), "idx", cache[0]._idx)

    # D joins: prefilled in its own BatchKVCache, then merged with extend
    d_ids, d_pad = left_pad([late["D"]])
    d_cache = model.make_batch_cache(d_pad)
    d_logits = model(d_ids, cache=d_cache)
    for t in range(d_ids.shape[1]):
        logged["D"].append((t, d_logits[0, t]))
    for c, dc in zip(cache, d_cache):
        c.extend(dc)
    order = order + ["D"]
    nxt = torch.cat([nxt, d_logits[:, -1].argmax(-1)])
    print("after extend: left_padding", cache[0].left_padding.tolist(), "idx", cache[0]._idx,
          "offset", cache[0].offset.tolist())

    decode(5)

    # reference: each sequence alone, unpadded, no cache, causal
    max_err = 0.0
    n_rows = 0
    for k, toks in seqs.items():
        full = model(torch.tensor([toks]))[0]
        for pos, row in logged[k]:
            max_err = max(max_err, (full[pos] - row).abs().max().item())
            n_rows += 1
    ok = max_err < 1e-4
    print(f"compared {n_rows} logit rows over {len(seqs)} sequences, max abs diff {max_err:.2e}")
    print("batched left-padded cache == each sequence alone:", ok)
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
