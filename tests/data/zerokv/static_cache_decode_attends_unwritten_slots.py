"""A decoder with a preallocated KV cache that attends the whole cache buffer (written here, for checks/zerokv.py).

Bug: the cache holds `max_len` slots per row, zeros until written; each step writes its keys and values at the next
slots and then calls SDPA over every slot with `is_causal=False` and no mask (the step's author took the cache's
slots for keys already written), so every query also attends the unwritten slots after it.
Fix: hand SDPA a bool mask that keeps each query to the slots at or before its own position.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CachedAttention(nn.Module):
    def __init__(self, dim=32, heads=4, batch=2, max_len=12):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, dim // heads))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, dim // heads))

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        self.k_cache[:, :, start:start + n] = k
        self.v_cache[:, :, start:start + n] = v
        mask = None
        if FIXED:
            slots = torch.arange(self.k_cache.shape[2])
            mask = slots[None, :] <= (start + torch.arange(n))[:, None]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, vocab=30, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = CachedAttention(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x, start))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Model().eval()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        logits, start = model(ids, 0), 0
        for _ in range(3):
            start += ids.shape[1]
            ids = logits[:, -1:].argmax(-1)
            logits = model(ids, start)
    print("last", ids.flatten().tolist())
