"""mlx-lm BatchRotatingKVCache.extract: an unpadded row keeps the buffer's unwritten slots.

Citation: ml-explore/mlx-lm#738 ("Fix sliding window batching", commit 509f5aef),
cache.py half; diff read in the upstream history. Torch port of the MLX code.

Bug: `extract(idx)` sliced the row's keys/values to `[padding : cache._idx]` only
`if padding > 0`. For the longest prompt of the batch (left padding 0) the
extracted RotatingKVCache kept the whole preallocated buffer (the decode step
grows it to max_size with zeros), and `cache._idx = cache.keys.shape[2]` then
counted the unwritten zero slots as tokens. Continuing from that cache, the next
`_update_in_place` sees `_idx == max_size`, rotates, and overwrites slot 0 (the
first real token) while the zero slots stay in the returned keys; single-token
decode uses no mask, so the query attends the empty slots.

Fix: slice unconditionally, `cache.keys[:, :, padding : cache._idx]`.

This program: BatchRotatingKVCache (prefill concat, in-place decode, make_mask),
RotatingKVCache (in-place decode), create_causal_mask and one attention layer
calling F.scaled_dot_product_attention (MLX's fast SDPA stand-in; bool mask =
keep). Two left-padded prompts (4 and 6 tokens), max_size 16, two batched decode
steps, then row 1 (padding 0) is extracted and decoded one more token alone.
"""
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, N_HEADS, HEAD_DIM = 16, 2, 8


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None,
                       left_padding: Optional[torch.Tensor] = None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if left_padding is not None:
        mask = mask & (left_padding.view(-1, 1, 1, 1) <= rinds)
    return mask


class RotatingKVCache:
    step = 256

    def __init__(self, max_size, keep=0):
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep:, :]]
        else:
            to_cat = [v]
        if append is not None:
            to_cat.append(append)
        return torch.cat(to_cat, dim=2)

    def _update_in_place(self, keys, values):
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            new_size = min(self.step, self.max_size - prev)
            new_k = torch.zeros(B, n_kv_heads, new_size, k_head_dim)
            new_v = torch.zeros(B, n_kv_heads, new_size, values.shape[3])
            if self.keys is not None:
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[..., self._idx: self._idx + S, :] = keys
        self.values[..., self._idx: self._idx + S, :] = values
        self.offset += S
        self._idx += S
        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys, values):
        assert keys.shape[2] == 1
        return self._update_in_place(keys, values)

    def make_mask(self, N: int, window_size: Optional[int] = None):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            return create_causal_mask(N, offset, window_size=window_size)
        return None


class BatchRotatingKVCache:
    step = 256

    def __init__(self, max_size, left_padding: List[int]):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self.max_size = max_size
        self._idx = 0
        self._offset = 0
        self.rotated = False

    def _update_concat(self, keys, values):
        assert self.keys is None
        self.keys = keys
        self.values = values
        self.offset += keys.shape[2]
        self._offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self._offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            new_size = min(self.step, self.max_size - prev)
            new_k = torch.zeros(B, n_kv_heads, new_size, k_head_dim)
            new_v = torch.zeros(B, n_kv_heads, new_size, values.shape[3])
            if self.keys is not None:
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self.keys[..., trim_size:, :]
            self.values = self.values[..., trim_size:, :]
            self._idx = self.max_size
            self.left_padding -= trim_size
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= S
        self.keys[..., self._idx: self._idx + S, :] = keys
        self.values[..., self._idx: self._idx + S, :] = values
        self._offset += S
        self.offset += S
        self._idx += S
        if self._offset < self.max_size:
            return self.keys[..., : self._offset, :], self.values[..., : self._offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def make_mask(self, N: int, window_size: Optional[int] = None):
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = torch.arange(offset + N)
        linds = torch.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds >= rinds
        mask &= linds < rinds + window_size
        if (trim_size := self._idx - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim_size
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left_padding = left_padding - 1
        mask = mask & (rinds >= left_padding.view(-1, 1, 1, 1))
        if rotated:
            idx = self._idx
            if idx >= self.max_size:
                idx = 0
            mask = torch.roll(mask, shifts=idx + 1, dims=-1)
        return mask

    def extract(self, idx):
        cache = RotatingKVCache(self.max_size)
        padding = self.left_padding[idx].item()
        offset = self.offset[idx].item()
        cache.keys = self.keys[idx: idx + 1]
        cache.values = self.values[idx: idx + 1]
        cache._idx = self._idx
        if self.rotated:
            cache.keys = torch.roll(cache.keys, -self._idx, dims=2)
            cache.values = torch.roll(cache.values, -self._idx, dims=2)
            cache._idx = self.max_size
        if FIXED:
            cache.keys = cache.keys[:, :, padding: cache._idx].contiguous()
            cache.values = cache.values[:, :, padding: cache._idx].contiguous()
        elif padding > 0:
            cache.keys = cache.keys[:, :, padding: cache._idx].contiguous()
            cache.values = cache.values[:, :, padding: cache._idx].contiguous()
        cache.offset = offset
        cache._idx = cache.keys.shape[2]
        return cache


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.scale = HEAD_DIM ** -0.5

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q = self.q_proj(x).view(B, L, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(B, L, N_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(B, L, N_HEADS, HEAD_DIM).transpose(1, 2)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, D))


embed = torch.nn.Embedding(64, HIDDEN)
attn = Attention().eval()
PAD = 0
prompts = [[7, 3, 19, 42], [5, 11, 28, 9, 33, 14]]
max_len = max(len(p) for p in prompts)
left_padding = [max_len - len(p) for p in prompts]
inputs = torch.tensor([[PAD] * lp + p for lp, p in zip(left_padding, prompts)])

with torch.no_grad():
    cache = BatchRotatingKVCache(max_size=16, left_padding=left_padding)
    h = embed(inputs)
    mask = cache.make_mask(h.shape[1])
    out = attn(h, mask=mask, cache=cache)
    for tok in ([21, 37], [8, 50]):
        h = embed(torch.tensor(tok)[:, None])
        mask = cache.make_mask(1)
        out = attn(h, mask=mask, cache=cache)

    # Row 1 finishes in the batch; its cache is extracted and generation continues alone.
    single = cache.extract(1)
    h = embed(torch.tensor([[44]]))
    mask = single.make_mask(1)
    out = attn(h, mask=mask, cache=single)
    print("extracted cache slots:", single.keys.shape[2], "offset:", single.offset)
    print("next hidden[:4]:", [round(x, 4) for x in out[0, -1, :4].tolist()])
    print("next token:", int((out[0, -1] @ embed.weight.T).argmax()))
