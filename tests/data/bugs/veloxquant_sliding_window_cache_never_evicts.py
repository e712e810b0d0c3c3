# rajveer43/VeloxQuant-MLX#274 (fixed by #388): SlidingWindowKVCache._rebuild_inner() reset the inner cache only
# if it had a `_k_indices` attribute, which no cache class has, so decode attended over the whole history.
import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class TurboQuantKVCache:
    """Inner cache (quantization left out): keys/values appended along the sequence axis."""

    def __init__(self, num_heads, head_dim):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.reset()

    def reset(self):
        self._k_indices_packed = torch.zeros(1, self.num_heads, 0, self.head_dim)
        self._v_cache = torch.zeros(1, self.num_heads, 0, self.head_dim)
        self._size = 0

    def append(self, k, v):
        self._k_indices_packed = torch.cat([self._k_indices_packed, k], dim=2)
        self._v_cache = torch.cat([self._v_cache, v], dim=2)
        self._size += k.shape[2]

    def attend(self, q):
        return F.scaled_dot_product_attention(q, self._k_indices_packed, self._v_cache)

    def __len__(self):
        return self._size


class SlidingWindowKVCache:
    """Bounds a wrapped cache to the last `window_size` tokens."""

    def __init__(self, inner, window_size):
        self._inner = inner
        self.window_size = window_size
        self._window_k, self._window_v = [], []

    def _rebuild_inner(self):
        if FIXED:
            self._inner.reset()
            fresh = self._inner
        else:
            fresh = copy.deepcopy(self._inner)
            if hasattr(fresh, "_k_indices"):
                fresh.reset()
        for k, v in zip(self._window_k, self._window_v):
            fresh.append(k, v)
        self._inner = fresh

    def append(self, k, v):
        for t in range(k.shape[2]):
            self._window_k.append(k[:, :, t:t + 1])
            self._window_v.append(v[:, :, t:t + 1])
        if len(self._window_k) > self.window_size:
            self._window_k = self._window_k[-self.window_size:]
            self._window_v = self._window_v[-self.window_size:]
            self._rebuild_inner()
        else:
            self._inner.append(k, v)

    def attend(self, q):
        return self._inner.attend(q)

    def __len__(self):
        return min(len(self._window_k), self.window_size)


class Attention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cache):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        cache.append(k, v)
        return self.o(cache.attend(q).transpose(1, 2).reshape(b, t, -1))


def main():
    torch.manual_seed(0)
    window_size = 4
    layer = Attention().eval()
    xs = torch.randn(1, 10, 32)
    cache = SlidingWindowKVCache(TurboQuantKVCache(4, 8), window_size=window_size)
    max_diff = 0.0
    with torch.no_grad():
        for t in range(xs.shape[1]):  # token-by-token decode
            out = layer(xs[:, t:t + 1], cache)
            # reference: attention over exactly the last `window_size` tokens
            lo = max(0, t + 1 - window_size)
            _, k, v = layer.qkv(xs[:, lo:t + 1]).view(1, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
            q = layer.qkv(xs[:, t:t + 1]).view(1, 1, 3, 4, 8).permute(2, 0, 3, 1, 4)[0]
            ref = layer.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 1, -1))
            max_diff = max(max_diff, (out - ref).abs().max().item())
    print(f"fixed={FIXED} len(cache)={len(cache)} inner keys={len(cache._inner)} "
          f"decode vs window reference max diff: {max_diff:.4e}")


if __name__ == "__main__":
    main()
