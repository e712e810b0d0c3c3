# lablup/mlxcel#418 (fixes #413): dense-KVCache sliding-window models (cohere2, olmo3) built the clamped
# [size, window] prefill mask that assumes a cache trimmed to `window` keys; on a non-fresh prefill whose key
# span exceeds the window, K/V got sliced to that mask and early queries lost keys inside their window.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class KVCache:
    """Dense cache: keeps every key."""

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        self.offset += k.shape[2]
        return self.keys, self.values


def create_causal_mask(n, offset, window_size=None):
    rinds = torch.arange(offset + n)[None, :]
    linds = torch.arange(offset, offset + n)[:, None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def create_sliding_window_prefill_mask(size, sliding_offset, window):
    if size > window and sliding_offset == 0:
        return create_causal_mask(size, 0, window)
    # clamped [size, window] mask: assumes the cache holds only the last `window` keys
    return create_causal_mask(size, sliding_offset, window)[:, -window:]


def create_sliding_window_prefill_mask_dense(size, sliding_offset, window):
    # a dense cache keeps every key: full windowed-causal mask over all retained keys
    return create_causal_mask(size, sliding_offset, window)


class Cohere2Attention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, mask, cache):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        k, v = cache.update_and_fetch(k, v)
        # the attention layer slices K/V to the mask's key axis
        k, v = k[:, :, -mask.shape[-1]:], v[:, :, -mask.shape[-1]:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Cohere2Model(nn.Module):
    def __init__(self, vocab=64, hidden=32, layers=2, sliding_window=4):
        super().__init__()
        self.sliding_window = sliding_window
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Cohere2Attention(hidden) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, caches):
        h = self.embed(ids)
        size, offset = ids.shape[1], caches[0].offset
        if FIXED:
            mask = create_sliding_window_prefill_mask_dense(size, offset, self.sliding_window)
        else:
            mask = create_sliding_window_prefill_mask(size, offset, self.sliding_window)
        for layer, cache in zip(self.layers, caches):
            h = h + layer(h, mask, cache)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    model = Cohere2Model().eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        ref = model(ids, [KVCache(), KVCache()])  # fresh prefill: full windowed-causal mask
        caches = [KVCache(), KVCache()]
        model(ids[:, :5], caches)                 # first chunk
        out = model(ids[:, 5:], caches)           # second chunk: offset 5, size 4, window 4
    diff = (out - ref[:, 5:]).abs().max().item()
    print(f"fixed={FIXED} chunked vs one-shot prefill logits max diff: {diff:.4e}")


if __name__ == "__main__":
    main()
