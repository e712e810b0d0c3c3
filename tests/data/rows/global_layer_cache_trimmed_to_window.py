"""A hand-written hybrid decoder (layer 0 local with a window of 4, layer 1 global) whose per-layer caches are trimmed
after each step by one routine that cuts every layer to the window, the global one included: at each decode step
the global layer's query sees the last 4 keys and its own, not every position (--fixed: only the local layer's cache
is trimmed). `attend` holds `sliding_window = -1` and `start_pos` for the global layer."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
WINDOW = 4


def attend(q, keys, values, positions, start_pos, sliding_window):
    """q: (1, heads, Lq, d) at positions start_pos ..; keys/values: (1, heads, Lk, d) at `positions` (Lk,)."""
    q_pos = torch.arange(start_pos, start_pos + q.shape[2])[:, None]
    keep = positions[None, :] <= q_pos
    if sliding_window > 0:
        keep = keep & (q_pos - positions[None, :] < sliding_window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=keep)


class Block(nn.Module):
    def __init__(self, dim, heads, sliding_window):
        super().__init__()
        self.heads, self.sliding_window = heads, sliding_window
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, cache, start_pos):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        new_pos = torch.arange(start_pos, start_pos + t)
        if cache:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            new_pos = torch.cat([cache["pos"], new_pos])
        cache.update(k=k, v=v, pos=new_pos)
        out = attend(q, k, v, new_pos, start_pos, self.sliding_window)
        return x + out.transpose(1, 2).reshape(b, t, d)


def trim(caches, layers):
    for cache, layer in zip(caches, layers):
        if FIXED and layer.sliding_window < 0:
            continue  # a global layer keeps every key
        for name in ("k", "v"):
            cache[name] = cache[name][:, :, -WINDOW:]
        cache["pos"] = cache["pos"][-WINDOW:]


def main():
    torch.manual_seed(0)
    dim, heads = 16, 2
    embed = nn.Embedding(32, dim)
    layers = nn.ModuleList([Block(dim, heads, WINDOW), Block(dim, heads, -1)]).eval()
    caches = [{}, {}]
    ids = torch.randint(0, 32, (1, 7))
    start_pos = 0
    with torch.no_grad():
        for step in range(3):
            h = embed(ids)
            for layer, cache in zip(layers, caches):
                h = layer(h, cache, start_pos)
            trim(caches, layers)
            start_pos += ids.shape[1]
            ids = h[:, -1:].sum(-1).long().abs() % 32
    print("last hidden norm %.4f" % h.norm().item())


if __name__ == "__main__":
    main()
