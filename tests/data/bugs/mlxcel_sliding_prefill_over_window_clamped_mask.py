"""mlxcel (Rust MLX engine) sliding-window prefill longer than the window: mask clamped to [seq_len, window].

Citation: lablup/mlxcel#405 ("fix(models): correct gemma sliding-window prefill beyond the window")
and its generalisation lablup/mlxcel#412 (closes #408). I read the PR descriptions, not the Rust
diffs; this is a torch port written from them, keeping the project's names (RotatingKVCache with
update_concat, create_causal_mask_with_window, causal_attention, sliding_window).

Bug: a fresh RotatingKVCache keeps every key on the first prefill pass (update_concat returns all
keys while the cache is empty) and trims to the window only on later decode steps. The sliding mask
was nevertheless built by create_causal_mask_with_window, which caps the key axis to `window`
whenever seq_len + offset > window, and causal_attention then sliced K/V to the trailing `window`
keys. For a single-pass prefill longer than the window, the earliest query rows (logical position
< seq_len - window) get an all -inf row (NaN / <pad>), and the rows near the cut see fewer keys
than their window.

Fix: for a multi-token prefill that exceeds the window (q_len > 1 and k_len > window) build the
full-width windowed-causal mask over ALL keys (create_causal_mask_with_window_full) and do not slice
K/V; the single-query decode path keeps the trailing-window slice.

Reproduction: a 1-layer Gemma-style sliding layer, sliding_window 4, a 10-token prompt in one
prefill pass, then one decode step. Attention is F.scaled_dot_product_attention with a bool mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    sliding_window: int = 4


class RotatingKVCache:
    def __init__(self, max_size):
        self.max_size = max_size
        self.keys = None
        self.values = None
        self.offset = 0

    def update_concat(self, k, v):
        # first pass keeps every prefill key; later passes keep the trailing max_size keys
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)[:, :, -(self.max_size + k.shape[2] - 1):]
            self.values = torch.cat([self.values, v], dim=2)[:, :, -(self.max_size + k.shape[2] - 1):]
        self.offset += k.shape[2]
        return self.keys, self.values


def create_causal_mask_with_window(seq_len, offset, window):
    """Key axis capped to `window` keys: assumes the cache returns only the latest window keys."""
    total = seq_len + offset
    k_len = min(total, window)
    q_pos = torch.arange(offset, total)[:, None]
    k_pos = torch.arange(total - k_len, total)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


def create_causal_mask_with_window_full(seq_len, offset, window):
    """Windowed-causal mask over every retained key: [seq_len, seq_len + offset]."""
    total = seq_len + offset
    q_pos = torch.arange(offset, total)[:, None]
    k_pos = torch.arange(0, total)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


def causal_attention(q, k, v, mask, window_size):
    k_len = k.shape[2]
    if window_size > 0 and k_len > window_size and (q.shape[2] == 1 or not FIXED):
        start = k_len - window_size
        k, v = k[:, :, start:], v[:, :, start:]
    if mask is not None:
        mask = mask[..., -k.shape[2]:]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.o_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.sliding_window = args.sliding_window

    def forward(self, x, mask, cache):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.n_heads, -1).transpose(1, 2)
        k, v = cache.update_concat(k, v)
        out = causal_attention(q, k, v, mask, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))


class Gemma3Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.self_attn = Attention(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, ids, cache):
        h = self.embed_tokens(ids)
        seq_len = ids.shape[1]
        mask = None
        if seq_len > 1:
            if FIXED and seq_len + cache.offset > self.args.sliding_window:
                mask = create_causal_mask_with_window_full(seq_len, cache.offset, self.args.sliding_window)
            else:
                mask = create_causal_mask_with_window(seq_len, cache.offset, self.args.sliding_window)
        h = h + self.self_attn(h, mask, cache)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = Gemma3Model(args).eval()
    cache = RotatingKVCache(args.sliding_window)
    prompt = torch.randint(0, args.vocab_size, (1, 10))
    with torch.no_grad():
        logits = model(prompt, cache)
        nxt = logits[:, -1:].argmax(-1)
        logits2 = model(nxt, cache)
    print("prefill argmax:", logits.argmax(-1).tolist(), "next:", logits2.argmax(-1).tolist())


if __name__ == "__main__":
    main()
