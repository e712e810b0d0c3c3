"""A GPT-style block over a hand-written KV cache whose single-token decode fast path calls SDPA without the mask.

The same slip as intel/ipex-llm PR #10433 (bigdl-llm's fp8 KV cache decode called `sdp_fp8(q, k, v)` without the
attention mask), written another way: a GPT-2-style fused qkv projection, a boolean key-padding mask of a left-padded
batch of three prompts kept by the caller and grown by one column per step, SDPA for the prompt pass and a "fast
path" for `q_len == 1` that drops `attn_mask`, so every decode step of the shorter prompts attends to their pads.
The fix hands the padding mask to the fast path too.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x, keep, layer_past=None):
        """keep: (B, kv) True where a key is a real token (the caller's padding mask, over the cache and x)."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if layer_past is not None:
            k, v = torch.cat([layer_past[0], k], dim=2), torch.cat([layer_past[1], v], dim=2)
        present = (k, v)
        if t == 1:  # decode fast path: one query sees every cached key, "no mask needed"
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] if FIXED else None)
        else:
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & keep[:, None, None, :])
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c)), present


attn = CausalSelfAttention().eval()
lengths, width, steps = [7, 4, 2], 7, 3
keep = torch.tensor([[i >= width - n for i in range(width)] for n in lengths])  # left padding
x = torch.randn(len(lengths), width + steps, 32)
with torch.no_grad():
    out, past = attn(x[:, :width], keep)
    for s in range(steps):
        keep = torch.cat([keep, torch.ones(len(lengths), 1, dtype=torch.bool)], dim=1)
        out, past = attn(x[:, width + s:width + s + 1], keep, past)
    alone, a_past = attn(x[2:, width - 2:width], keep[2:, width - 2:width])
    for s in range(steps):
        alone, a_past = attn(x[2:, width + s:width + s + 1], torch.ones(1, 3 + s, dtype=torch.bool), a_past)
print(f"max |padded batch decode - the short prompt alone| = {(out[2:] - alone).abs().max():.6f}")
