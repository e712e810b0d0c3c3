"""A ring-buffer sliding cache fed a prefill chunk longer than its window: the chunk overwrites slots its own queries need.

Written apart from litgpt#2182 (a LitGPT KVCache, one prompt in one pass, the global tril truncated to the buffer): a
window stated in a dict the model keeps (`self.config["sliding_window"]`), a batch of two rows, the second
left-padded, its `attention_mask` and `cache_position` handed to the model call, the prompt prefilled in two chunks
(3 tokens, then 6), an eager softmax with a finite fill, and a mask placed on the positions the slots hold (it is
no slicing slip: the slots themselves lost the keys). Bug: the layer writes the chunk into its W slots
(`slot = position % W`) before attending over them alone, so the second chunk of 6 keeps only its last 4 keys and
its first queries see none of their window. Fix (transformers' sliding layer): attend over the keys the slots held before
the write, in position order, and the chunk's own keys, then write.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
D, HEADS = 8, 2


class RingCache:
    def __init__(self, rows, window):
        self.k = torch.zeros(rows, HEADS, window, D // HEADS)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1)  # the position each slot holds (-1: none yet)

    def write(self, k, v, positions):
        for i, p in enumerate(positions.tolist()):  # (in order: a later position takes its slot)
            slot = p % self.pos.numel()
            self.k[:, :, slot], self.v[:, :, slot], self.pos[slot] = k[:, :, i], v[:, :, i], p


class SlidingAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, cache, cache_position, attention_mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if FIXED:
            order = torch.argsort(cache.pos)
            held = order[cache.pos[order] >= 0]  # the written slots, by position
            keys, values = torch.cat([cache.k[:, :, held], k], 2), torch.cat([cache.v[:, :, held], v], 2)
            kpos = torch.cat([cache.pos[held], cache_position])
            cache.write(k, v, cache_position)
        else:
            cache.write(k, v, cache_position)
            keys, values, kpos = cache.k, cache.v, cache.pos
        qpos = cache_position[:, None]
        allowed = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos) & (kpos[None, :] > qpos - self.config["sliding_window"])
        real = attention_mask[:, kpos.clamp(min=0)].bool() & (kpos >= 0)[None, :]  # (b, keys)
        allowed = allowed[None, None] & real[:, None, None, :]
        scores = (q @ keys.transpose(-1, -2)) / (D // HEADS) ** 0.5
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return (scores.softmax(-1) @ values).transpose(1, 2).reshape(b, n, D)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"sliding_window": 4, "num_hidden_layers": 1, "hidden_size": D}
        self.embed = nn.Embedding(32, D)
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": SlidingAttention(self.config)})])

    def forward(self, input_ids, attention_mask, cache_position, caches):
        h = self.embed(input_ids)
        for layer, cache in zip(self.layers, caches):
            h = h + layer["self_attn"](h, cache, cache_position, attention_mask)
        return h


torch.manual_seed(0)
model = Model().eval()
ids = torch.randint(1, 32, (2, 9))
ids[1, :2] = 0
mask = torch.ones(2, 9, dtype=torch.long)
mask[1, :2] = 0  # the second row left-padded by two
caches = [RingCache(2, model.config["sliding_window"])]
with torch.no_grad():
    for start, end in ((0, 3), (3, 9)):  # two prefill chunks, the second longer than the window
        out = model(ids[:, start:end], mask[:, :end], torch.arange(start, end), caches)
print("done", tuple(out.shape))
