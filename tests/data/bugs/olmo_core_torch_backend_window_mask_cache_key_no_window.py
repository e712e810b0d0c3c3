"""OLMo-core: TorchAttentionBackend caches its sliding-window mask under a key without the window.

Citation: allenai/OLMo-core PR #388, "Add sliding window support for torch attention backend" (merged).
The bug was reported in that PR's review thread (cursor[bot] on src/olmo_core/nn/attention/backend.py:
"Cache Key Omission Causes Attention Mask Errors"); the merged code keys the cache as
f"seq_len_q=...,seq_len_kv=...,window_size={window_size}" (read in the current backend.py). The buggy
key f"seq_len_q={seq_len_q},seq_len_kv={seq_len_kv}" is quoted from the review thread.

Bug: the mask cache (a BufferCache shared by all blocks of the model) was keyed by the two lengths only.
Layers whose sliding windows differ all received the mask built for whichever layer ran first.

Fix: include `window_size` in the cache key.

Reproduction: a two-block model whose SlidingWindowAttentionConfig pattern gives windows 2 and 5
(window_size (1, 0) and (4, 0), flash-style inclusive bounds), one shared BufferCache, sequence length 8.
With the bug the second block attends through the first block's narrow band.
"""
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class BufferCache(dict):
    """Model-wide cache of buffers (RoPE tables, masks) shared by every block."""

    def get_for_device(self, key: str, device: torch.device) -> Optional[torch.Tensor]:
        t = self.get(key)
        return None if t is None else t.to(device)


@dataclass
class SlidingWindowAttentionConfig:
    pattern: List[int] = field(default_factory=lambda: [2, 5])
    force_full_attention_on_first_layer: bool = False
    force_full_attention_on_last_layer: bool = False

    def get_window_size(self, layer_idx: int, n_layers: int) -> int:
        if self.force_full_attention_on_first_layer and layer_idx == 0:
            return -1
        if self.force_full_attention_on_last_layer and layer_idx == n_layers - 1:
            return -1
        return self.pattern[layer_idx % len(self.pattern)]


@dataclass
class TransformerConfig:
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    vocab_size: int = 50
    sliding_window: Optional[SlidingWindowAttentionConfig] = field(
        default_factory=SlidingWindowAttentionConfig)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class TorchAttentionBackend(nn.Module):
    def __init__(self, n_heads, n_kv_heads, window_size: Tuple[int, int], cache: BufferCache):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.window_size = window_size
        self.cache = cache

    def forward(self, qkv):
        q, k, v = qkv
        attn_mask = None
        if self.window_size != (-1, -1):
            attn_mask = self._get_sliding_window_mask(q.shape[1], k.shape[1], q.device,
                                                      self.window_size)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             is_causal=attn_mask is None)
        return att.transpose(1, 2).contiguous()

    def _get_sliding_window_mask(self, seq_len_q, seq_len_kv, device, window_size):
        if FIXED:
            key = f"seq_len_q={seq_len_q},seq_len_kv={seq_len_kv},window_size={window_size}"
        else:
            key = f"seq_len_q={seq_len_q},seq_len_kv={seq_len_kv}"
        if (mask := self.cache.get_for_device(key, device)) is not None:
            return mask
        attn_mask = self._build_sliding_window_mask(seq_len_q, seq_len_kv, device, window_size)
        self.cache[key] = attn_mask
        return attn_mask

    @classmethod
    def _build_sliding_window_mask(cls, seq_len_q, seq_len_kv, device, window_size):
        causal_mask = torch.tril(torch.ones(seq_len_q, seq_len_kv, device=device, dtype=torch.bool))
        left = torch.ones_like(causal_mask).triu(diagonal=-window_size[0])
        right = torch.ones_like(causal_mask).tril(diagonal=window_size[1])
        return causal_mask & left & right


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_idx: int, cache: BufferCache):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        self.w_q = nn.Linear(config.d_model, config.d_model, bias=False)
        self.w_k = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.w_v = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.w_out = nn.Linear(config.d_model, config.d_model, bias=False)
        window_size = (-1, -1)
        if config.sliding_window is not None:
            w = config.sliding_window.get_window_size(layer_idx, config.n_layers)
            if w > 0:
                window_size = (w - 1, 0)  # flash-attn convention: inclusive left bound
        self.backend = TorchAttentionBackend(self.n_heads, self.n_kv_heads, window_size, cache)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.w_q(x).view(b, s, self.n_heads, self.head_dim)
        k = self.w_k(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.w_v(x).view(b, s, self.n_kv_heads, self.head_dim)
        return self.w_out(self.backend((q, k, v)).view(b, s, -1))


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        cache = BufferCache()
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Attention(config, i, cache) for i in range(config.n_layers))
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids):
        h = self.embeddings(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    config = TransformerConfig()
    model = Transformer(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 8))
    with torch.no_grad():
        logits = model(input_ids)
    print("windows", [blk.backend.window_size for blk in model.blocks],
          "logits sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
