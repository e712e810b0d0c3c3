"""A prefix-prefill over a paged cache scores the cached context and the new tokens apart, then softmaxes them joined.

The engine's config (a SimpleNamespace at the top of the program) states sliding_window = 3. The new tokens of each
request attend to its cached context, read whole blocks at a time (the last block's unused slots masked), and to
themselves causally; the two score blocks are concatenated along the keys before one softmax. The buggy kernel masks
the context only by its length; `--fixed` also hides context keys 3 or more positions behind the query.
"""
import sys
from types import SimpleNamespace

import torch

FIXED = "--fixed" in sys.argv
ENGINE = SimpleNamespace(num_heads=2, head_dim=4, block_size=4, sliding_window=3)


def prefix_prefill(q, k_new, v_new, k_blocks, v_blocks, context_len, window):
    """q, k_new, v_new: (1, H, M, D); k_blocks, v_blocks: (1, H, blocks * block_size, D)."""
    m, slots = q.shape[2], k_blocks.shape[2]
    position = context_len + torch.arange(m)[:, None]          # each new token's position in its sequence
    slot = torch.arange(slots)[None, :]
    hidden_ctx = slot >= context_len
    if FIXED:
        hidden_ctx = hidden_ctx | (position - slot >= window)
    ctx_scores = (q @ k_blocks.transpose(-1, -2)).masked_fill(hidden_ctx, float("-inf"))
    later = torch.arange(m)[None, :] > torch.arange(m)[:, None]
    new_scores = (q @ k_new.transpose(-1, -2)).masked_fill(later, float("-inf"))
    weights = torch.softmax(torch.cat((ctx_scores, new_scores), dim=-1) / q.shape[-1] ** 0.5, dim=-1)
    return weights @ torch.cat((v_blocks, v_new), dim=2)


def main():
    torch.manual_seed(0)
    h, d, b = ENGINE.num_heads, ENGINE.head_dim, ENGINE.block_size
    context_len, new_tokens = 5, 3
    k_blocks, v_blocks = torch.randn(1, h, 2 * b, d), torch.randn(1, h, 2 * b, d)   # 2 blocks, 3 slots unused
    q, k_new, v_new = (torch.randn(1, h, new_tokens, d) for _ in range(3))
    out = prefix_prefill(q, k_new, v_new, k_blocks, v_blocks, context_len, ENGINE.sliding_window)
    print(out[0, 0, -1])


if __name__ == "__main__":
    main()
