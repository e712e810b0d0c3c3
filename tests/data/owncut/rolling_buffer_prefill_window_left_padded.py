# The bug of fla-org/flash-linear-attention#183 written another way: a Mistral-style rolling-buffer KV cache
# (mistral-inference's RotatingBufferCache: `sliding_window` slots, written at pos % sliding_window) and a
# FlashInfer-style prefill kernel told `window_left = sliding_window - 1`, over a left-padded batch. The buggy
# prefill attends to what the buffer holds after writing the prompt (its last `sliding_window` tokens) instead of the
# prompt's own keys, so the first real queries of each row see no key. --fixed: a prefill attends to its own keys
# and only later steps read the buffer.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def batch_prefill_with_kv_cache(q, k, v, key_valid, window_left):
    """(B, H, Lq, D) queries over (B, H, Lk, D) keys, aligned to the end (the last query is the last key's token), a
    query at p seeing keys p - window_left .. p that are not padding."""
    q_len, k_len = q.shape[2], k.shape[2]
    pos_q = torch.arange(q_len)[:, None] + (k_len - q_len)
    pos_k = torch.arange(k_len)[None, :]
    allowed = (pos_k <= pos_q) & (pos_k >= pos_q - window_left)
    allowed = allowed[None, None] & key_valid[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class RotatingBufferCache:
    def __init__(self, batch, heads, head_dim, sliding_window):
        self.sliding_window = sliding_window
        self.k = torch.zeros(batch, heads, sliding_window, head_dim)
        self.v = torch.zeros(batch, heads, sliding_window, head_dim)
        self.valid = torch.zeros(batch, sliding_window, dtype=torch.bool)
        self.seen = 0

    def write(self, k, v, valid):
        n = k.shape[2]
        for i in range(n):
            slot = (self.seen + i) % self.sliding_window
            self.k[:, :, slot], self.v[:, :, slot], self.valid[:, slot] = k[:, :, i], v[:, :, i], valid[:, i]
        self.seen += n

    def ordered(self):
        """The held keys oldest first (the buffer unrolled)."""
        if self.seen < self.sliding_window:
            return self.k[:, :, :self.seen], self.v[:, :, :self.seen], self.valid[:, :self.seen]
        shift = self.seen % self.sliding_window
        return (self.k.roll(-shift, 2), self.v.roll(-shift, 2), self.valid.roll(-shift, 1))


class Attention(nn.Module):
    def __init__(self, dim, heads, sliding_window):
        super().__init__()
        self.heads, self.head_dim, self.sliding_window = heads, dim // heads, sliding_window
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, valid, cache):
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        key_valid = valid
        if cache is not None:
            prefill = cache.seen == 0
            cache.write(k, v, valid)
            if not FIXED or not prefill:
                k, v, key_valid = cache.ordered()
        out = batch_prefill_with_kv_cache(q, k, v, key_valid, window_left=self.sliding_window - 1)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Transformer(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, layers=2, sliding_window=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim, heads, sliding_window) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, attention_mask, caches=None):
        h = self.embed(input_ids)
        valid = attention_mask.bool()
        for i, layer in enumerate(self.layers):
            h = h + layer(h, valid, None if caches is None else caches[i])
        return self.out(h)


model = Transformer().eval()
input_ids = torch.randint(1, 40, (2, 10))
attention_mask = torch.ones(2, 10, dtype=torch.long)
attention_mask[1, :3] = 0  # row 1 left-padded by 3
input_ids[1, :3] = 0
with torch.no_grad():
    caches = [RotatingBufferCache(2, 4, 8, 4) for _ in model.layers]
    logits = model(input_ids, attention_mask, caches)
print(f"fixed={FIXED} prefill logits finite: {bool(torch.isfinite(logits[attention_mask.bool()]).all())}")
