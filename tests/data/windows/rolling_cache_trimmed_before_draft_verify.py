"""A sliding-window decoder (window 4) with a rolling KV cache laid (B, H, L, D) whose `update` joins the new keys and
trims the cache to the window before returning it (the prompt attends over its own keys), so a multi-token step after the prompt (3 draft tokens verified at
once, as speculative decoding does) attends over the last 4 keys only: its first drafts lose keys inside their own
window. SDPA with an additive float mask (0 / finfo.min) over a left-padded batch (row 1 padded by 2) on absolute
positions. --fixed returns the last window + n - 1 keys to attend over and keeps only the last window in the cache.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
WINDOW = 4


class RollingKVCache:
    def __init__(self, window):
        self.window = window
        self.k = self.v = None
        self.start = 0  # absolute position of the cache's first key

    def prefill(self, k, v):
        """The prompt attends over its own keys; the cache keeps the last window of them."""
        self.k, self.v = k[:, :, -self.window:], v[:, :, -self.window:]
        self.start = k.shape[2] - self.k.shape[2]
        return k, v, 0

    def update(self, k, v):
        """Join k, v (B, H, n, D) to the cache; return (keys, values, position of the first key returned)."""
        n = k.shape[2]
        k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        total = k.shape[2]
        first = self.start
        if FIXED:
            keep = min(total, self.window + n - 1)
            keys, values = k[:, :, -keep:], v[:, :, -keep:]
            first_returned = first + total - keep
        self.k, self.v = k[:, :, -self.window:], v[:, :, -self.window:]
        self.start = first + total - self.k.shape[2]
        if not FIXED:
            keys, values, first_returned = self.k, self.v, self.start
        return keys, values, first_returned


class WindowAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache, pos, real):
        """x (B, n, D) at absolute positions pos .. pos + n - 1; real (B, total) True at a real token."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        k, v, first = cache.prefill(k, v) if cache.k is None else cache.update(k, v)
        q_pos = torch.arange(pos, pos + n)[:, None]
        k_pos = torch.arange(first, first + k.shape[2])[None, :]
        allowed = (k_pos <= q_pos) & (q_pos - k_pos < WINDOW)
        allowed = allowed[None, None] & real[:, None, None, first:first + k.shape[2]]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    layer = WindowAttention().eval()
    tokens = torch.randn(2, 14, 32)
    real = torch.ones(2, 14, dtype=torch.bool)
    real[1, :2] = False  # row 1 left-padded by 2
    with torch.no_grad():
        cache = RollingKVCache(WINDOW)
        outs = [layer(tokens[:, :8], cache, 0, real)]  # the prompt
        for pos in (8, 11):  # two verify steps of 3 draft tokens each
            outs.append(layer(tokens[:, pos:pos + 3], cache, pos, real))
        stepped = torch.cat(outs, dim=1)
        whole = layer(tokens, RollingKVCache(64), 0, real)
    print(f"max |stepped - one pass| on row 0: {(stepped[0] - whole[0]).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
