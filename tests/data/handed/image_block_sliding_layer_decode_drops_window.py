"""A vision-language decoder's sliding layer, written the way Gemma 3's ports write it: text is causal, the tokens of
one image attend each other both ways, and every layer keeps to window_size=(3, 0) (a query at p sees keys p - 3 .. p
before it). The window bounds only the keys before a query: an image token sees the later tokens of its own image.

Bug: the decode step takes a shortcut that masks the batch's padding alone (nanochat#452's Tq == 1 path), so a new
token attends every cached key. Fixed: the decode step keeps the window as the prefill does."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
IMAGE = 7  # the image placeholder id


def attend(q, k, v, keep, window_size):
    left = window_size[0]
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len == 1 and not FIXED:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])  # the shortcut: padding alone
    rows = torch.arange(k_len - q_len, k_len)[:, None]
    near = torch.arange(k_len)[None, :] >= rows - left  # (the window bounds the keys before the query alone)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(keep & near)[:, None])


class Layer(nn.Module):
    def __init__(self, hidden=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.window_size = (3, 0)

    def forward(self, x, keep, cache=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        out = attend(q, k, v, keep, self.window_size)
        return x + self.out(out.transpose(1, 2).reshape(b, n, -1)), (k, v)


def prefill_mask(ids, real):
    n = ids.shape[1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    image = ids == IMAGE
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    block = torch.cumsum(starts, dim=1) * image  # each image's number on its tokens, 0 on text
    both_ways = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)
    return (causal | both_ways) & real[:, None, :] & real[:, :, None] | torch.eye(n, dtype=torch.bool)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(2)).eval()
    embed = nn.Embedding(16, 32)
    ids = torch.tensor([[1, 2, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 3, 4, 5, 6],
                        [0, 0, 0, 1, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 2, 3]])
    real = ids != 0
    keep = prefill_mask(ids, real)
    x, caches = embed(ids), []
    for layer in layers:
        x, cache = layer(x, keep, None)
        caches.append(cache)
    for step in range(3):
        real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        x = embed(torch.randint(1, 7, (2, 1)))
        for i, layer in enumerate(layers):
            x, caches[i] = layer(x, real[:, None, :], caches[i])
    print(x.norm().item())


if __name__ == "__main__":
    main()
