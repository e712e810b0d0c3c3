"""lablup/mlxcel#891: Gemma 4 served with chunked prefill built each continuation chunk's mask from the scheduler's
kv_offset, read from placeholder caches (0), so the mask covered the chunk's own keys only; attention met the cache's
real keys (earlier chunks + the chunk), found the mask the wrong size and dropped it, so every query of a later chunk
attended to the whole chunk, later tokens included. The fix sizes the prefill mask to the keys the cache returns:
chunked prefill then matches one pass. Reduced to torch: a model prefilled chunk by chunk against its KV cache."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def create_prefill_mask(chunk_len, kv_offset):
    """Causal over [cache | chunk]: query i of the chunk sees the kv_offset cached keys and the chunk up to i."""
    i = torch.arange(chunk_len)[:, None] + kv_offset
    return torch.arange(kv_offset + chunk_len)[None, :] <= i


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.k_cache = self.v_cache = None

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.k_cache is not None:
            k, v = torch.cat([self.k_cache, k], dim=2), torch.cat([self.v_cache, v], dim=2)
        self.k_cache, self.v_cache = k, v
        if mask is not None and mask.shape[-1] != k.shape[2]:
            mask = None  # a mask sized for other keys is discarded
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Model(nn.Module):
    def __init__(self, vocab=32, dim=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))

    def forward(self, input_ids, mask):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask).transpose(1, 2).reshape(h.shape)
        return h


torch.manual_seed(0)
model = Model().eval()
prompt = torch.arange(1, 13)[None]
cached = 0  # what the model's own caches hold
with torch.no_grad():
    for start in range(0, prompt.shape[1], 4):  # prefill_chunk_size = 4
        chunk = prompt[:, start:start + 4]
        kv_offset = cached if FIXED else 0  # the bug: the offset of placeholder caches
        model(chunk, create_prefill_mask(chunk.shape[1], kv_offset))
        cached += chunk.shape[1]
