"""pytorch/executorch#20346: the Gemma 4 runner prefilled in chunks of 2 * sliding_window into a sliding layer's ring
KV cache of 2 * sliding_window slots. A chunk as long as the cache overwrote all of it, so after writing a chunk the
cache held only that chunk's keys, and the first queries of every later chunk lost the tail of the previous chunk that
was still inside their window: chunked prefill no longer matched one pass. The fix caps the prefill chunk at the
sliding window. Reduced to torch (a window of 4, the cache kept in position order)."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
SLIDING_WINDOW = 4


class SlidingAttention(nn.Module):
    def __init__(self, dim=16, heads=2, window=SLIDING_WINDOW):
        super().__init__()
        self.heads, self.window, self.cache_len = heads, window, 2 * window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.k = self.v = torch.zeros(1, heads, 0, dim // heads)
        self.pos = torch.zeros(0, dtype=torch.long)

    def forward(self, x, input_pos):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        # the ring buffer: the last cache_len keys written, this chunk's included
        self.k = torch.cat([self.k, k], dim=2)[:, :, -self.cache_len:]
        self.v = torch.cat([self.v, v], dim=2)[:, :, -self.cache_len:]
        self.pos = torch.cat([self.pos, input_pos])[-self.cache_len:]
        delta = input_pos[:, None] - self.pos[None, :]
        mask = (delta >= 0) & (delta < self.window)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)


class Model(nn.Module):
    def __init__(self, vocab=32, dim=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(SlidingAttention(dim) for _ in range(layers))

    def forward(self, tokens, input_pos):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, input_pos).transpose(1, 2).reshape(h.shape)
        return h


torch.manual_seed(0)
model = Model().eval()
prompt = torch.arange(1, 17)[None]
chunk_size = SLIDING_WINDOW if FIXED else 2 * SLIDING_WINDOW  # get_max_prefill_chunk: 2 * sliding_window
with torch.no_grad():
    for start in range(0, prompt.shape[1], chunk_size):
        chunk = prompt[:, start:start + chunk_size]
        model(chunk, torch.arange(start, start + chunk.shape[1]))
