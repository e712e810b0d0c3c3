"""A decoder whose local layer slices its growing cache to the window before each decode step's SDPA call.

`step` holds `sliding_window = 5` beside the query's position `start_pos`; a window of 5 is the query and the 4 keys
before it. The buggy version keeps `cache[:, :, start_pos - sliding_window + 2:]` (4 keys, the query's own among
them: the oldest key of its window cut); `--fixed` keeps `start_pos - sliding_window + 1` on (5 keys). Prefill is one
SDPA call with the window as a boolean mask; decode calls are handed no mask (every key handed is in the window).
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
HEADS, DIM = 2, 8


def prefill(q, k, v, sliding_window):
    n = q.shape[2]
    i = torch.arange(n)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def step(q, cache_k, cache_v, start_pos, sliding_window):
    first = max(0, start_pos - sliding_window + (1 if FIXED else 2))
    return F.scaled_dot_product_attention(q, cache_k[:, :, first:start_pos + 1], cache_v[:, :, first:start_pos + 1])


def main():
    sliding_window, prompt = 5, 7
    k = torch.randn(1, HEADS, prompt, DIM)
    v = torch.randn(1, HEADS, prompt, DIM)
    out = prefill(torch.randn(1, HEADS, prompt, DIM), k, v, sliding_window)
    total = float(out.sum())
    for start_pos in range(prompt, prompt + 3):
        k = torch.cat([k, torch.randn(1, HEADS, 1, DIM)], dim=2)
        v = torch.cat([v, torch.randn(1, HEADS, 1, DIM)], dim=2)
        total += float(step(torch.randn(1, HEADS, 1, DIM), k, v, start_pos, sliding_window).sum())
    print(f"sum of outputs {total:.4f}")


main()
