"""LitGPT: sliding-window layers attend the whole context once a KV cache is used (Gemma-3 long generation).

Citation: Lightning-AI/litgpt issue #2145, fixed by PR #2153 ("fix: sliding window KV cache for Gemma-3
models", commit 3023ca8). Code follows `litgpt/model.py` before that commit (`GPT.forward` mask from
`build_mask_cache`, `CausalSelfAttention.forward`, `KVCache`), cut to one block without RoPE/MLP.

Bug: with a KV cache, `GPT.forward` hands each block `mask = mask_cache[..., input_pos, :input_pos_maxp1]`,
a *boolean* (True = attend) causal mask. The sliding-window branch was written for the float (-inf)
mask of training: `sliding_window_bias = ones_like(mask).tril(diagonal=-sliding_window_size)`,
`masked_fill_(..., -inf)`, `mask += sliding_window_bias`. On a bool mask that is a logical OR, and for a
one-row decode mask the `tril` is computed on row 0 anyway, so the window removes nothing: Gemma-3's
local layers attend the full history during generation (gibberish after ~1k tokens, the 1024 window).

Fix: sliding-window layers get a KV cache of `sliding_window_size` slots used as a ring buffer
(`input_pos % max_cache_len`), the mask is sliced to the cache's actual length, and the explicit window
mask is only built when there is no cache (`input_pos is None`).

Reproduction: `Config(sliding_window_size=4, sliding_window_indices=[1])`, one block, a 3-token prompt
then greedy decode to 10 positions with `input_pos` / `input_pos_maxp1` as `litgpt.generate` passes them;
attention is `F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`.
"""
import math
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Config:
    name: str = "gemma-3-tiny"
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 1
    n_head: int = 2
    n_query_groups: int = 2
    n_embd: int = 32
    sliding_window_size: Optional[int] = 4
    sliding_window_indices: List[int] = field(default_factory=lambda: [1])

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


def build_mask_cache(max_seq_length: int, device=None) -> torch.Tensor:
    ones = torch.ones((max_seq_length, max_seq_length), device=device, dtype=torch.bool)
    return torch.tril(ones).unsqueeze(0).unsqueeze(0)


def batched_index_copy_(t, dim, idx, val):
    return t.index_copy_(dim, idx, val)


class KVCache(nn.Module):
    def __init__(self, k_shape, v_shape, is_sliding_window=False, sliding_window_size=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape), persistent=False)
        self.is_sliding_window = is_sliding_window
        self.sliding_window_size = sliding_window_size
        self.max_cache_len = k_shape[2]

    def forward(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        bs = k.size(0)
        if self.is_sliding_window:
            # Circular buffer for sliding window
            cache_positions = input_pos % self.max_cache_len
            k = batched_index_copy_(self.k[:bs, ...], -2, cache_positions, k)
            v = batched_index_copy_(self.v[:bs, ...], -2, cache_positions, v)
            max_pos = input_pos.max().item()
            if max_pos < self.max_cache_len:
                k = k[:, :, : max_pos + 1, :]
                v = v[:, :, : max_pos + 1, :]
        else:
            k = batched_index_copy_(self.k[:bs, ...], -2, input_pos, k)
            v = batched_index_copy_(self.v[:bs, ...], -2, input_pos, v)
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size, bias=False)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=False)
        self.kv_cache: Optional[KVCache] = None
        self.apply_sliding_window_attention = (
            config.sliding_window_size is not None and block_idx in config.sliding_window_indices
        )

    def forward(self, x, mask=None, input_pos=None, input_pos_maxp1=None):
        head_size, n_head, n_query_groups = self.config.head_size, self.config.n_head, self.config.n_query_groups
        B, T, C = x.size()
        q, k, v = self.qkv(x).split((n_head * head_size, n_query_groups * head_size, n_query_groups * head_size), dim=-1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)

        if input_pos is not None:
            k, v = self.kv_cache(input_pos, k, v)
            if FIXED and self.apply_sliding_window_attention:
                actual_kv_len = k.size(2)
                if mask is not None and mask.size(-1) != actual_kv_len:
                    mask = mask[..., :actual_kv_len]
            if input_pos_maxp1 is not None:
                k = k[..., :input_pos_maxp1, :]
                v = v[..., :input_pos_maxp1, :]

        if self.apply_sliding_window_attention:
            if FIXED:
                if input_pos is None:
                    sliding_window_mask = torch.full((T, T), float("-inf"), dtype=q.dtype)
                    for i in range(T):
                        window_start = max(0, i - self.config.sliding_window_size + 1)
                        sliding_window_mask[i, window_start : i + 1] = 0.0
                    mask = sliding_window_mask.view(1, 1, T, T)
            else:
                if mask is None:
                    mask = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
                    mask.masked_fill_(mask.bool(), float("-inf"))
                    mask = mask.view(1, 1, *mask.shape)
                sliding_window_bias = torch.ones_like(mask).tril(diagonal=-self.config.sliding_window_size)
                sliding_window_bias.masked_fill_(sliding_window_bias.bool(), float("-inf"))
                mask += sliding_window_bias

        scale = 1.0 / math.sqrt(head_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, head_size * n_head))

    def build_kv_cache(self, batch_size: int, max_seq_length: int) -> KVCache:
        if FIXED and self.apply_sliding_window_attention and self.config.sliding_window_size is not None:
            effective_cache_size = min(max_seq_length, self.config.sliding_window_size)
        else:
            effective_cache_size = max_seq_length
        shape = (batch_size, self.config.n_query_groups, effective_cache_size, self.config.head_size)
        return KVCache(shape, shape, is_sliding_window=FIXED and self.apply_sliding_window_attention,
                       sliding_window_size=self.config.sliding_window_size)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(CausalSelfAttention(config, block_idx=i + 1) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.mask_cache: Optional[torch.Tensor] = None
        self.max_seq_length = config.block_size

    def set_kv_cache(self, batch_size: int) -> None:
        for block in self.h:
            block.kv_cache = block.build_kv_cache(batch_size, self.max_seq_length)
        self.mask_cache = build_mask_cache(self.max_seq_length)

    def forward(self, idx, input_pos=None, input_pos_maxp1=None):
        mask = None
        if input_pos is not None:
            mask = self.mask_cache.index_select(2, input_pos)
            if input_pos_maxp1 is not None:
                mask = mask[..., :input_pos_maxp1]
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x, mask, input_pos, input_pos_maxp1)
        return self.lm_head(x)


def main():
    config = Config()
    model = GPT(config).eval()
    model.set_kv_cache(batch_size=1)
    prompt = torch.randint(0, config.vocab_size, (3,))
    tokens = prompt.tolist()
    with torch.no_grad():
        input_pos = torch.arange(len(tokens))
        logits = model(prompt[None], input_pos, input_pos_maxp1=len(tokens))
        for _ in range(10 - len(prompt)):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            input_pos = torch.tensor([len(tokens) - 1])
            logits = model(torch.tensor([[token]]), input_pos, input_pos_maxp1=len(tokens))
    print("generated", tokens[len(prompt):])


if __name__ == "__main__":
    main()
