# ollama/ollama#15591 (x/mlxrunner/cache RotatingKVCache, Go/MLX, torch port): after the ring buffer wrapped, a
# multi-token Update went through concat's slice-to-[0, idx) path and discarded slots [idx, maxSize), so the first
# queries of the new chunk lost older tokens still inside their sliding window.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
SLIDING_WINDOW = 8


class RotatingKVCache:
    def __init__(self, max_size):
        self.max_size, self.keys, self.values, self.offset, self.idx = max_size, None, None, 0, 0

    def update(self, keys, values):
        if keys.shape[2] > 1:
            return self.concat(keys, values)
        return self.update_one(keys, values)

    def concat(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys.clone(), values.clone()
        else:
            if FIXED and self.offset > self.max_size:
                # wrapped: linearize the circular buffer to logical order
                self.keys = torch.cat([self.keys[:, :, self.idx:], self.keys[:, :, :self.idx]], 2)
                self.values = torch.cat([self.values[:, :, self.idx:], self.values[:, :, :self.idx]], 2)
                self.idx = self.keys.shape[2]
            elif self.idx < self.keys.shape[2]:
                self.keys = self.keys[:, :, :self.idx]
                self.values = self.values[:, :, :self.idx]
            trim = self.idx - self.max_size + 1  # trim to max_size to maintain sliding window
            if trim > 0:
                self.keys, self.values = self.keys[:, :, trim:], self.values[:, :, trim:]
            self.keys = torch.cat([self.keys, keys], 2)
            self.values = torch.cat([self.values, values], 2)
        self.offset += keys.shape[2]
        self.idx = self.keys.shape[2]
        return self.keys, self.values

    def update_one(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            new_size = min(256, self.max_size - prev)
            z = keys.new_zeros(keys.shape[0], keys.shape[1], new_size, keys.shape[3])
            self.keys = z if self.keys is None else torch.cat([self.keys, z], 2)
            self.values = z.clone() if self.values is None else torch.cat([self.values, z.clone()], 2)
            self.idx = prev
        trim = self.keys.shape[2] - self.max_size
        if trim > 0:
            self.keys, self.values = self.keys[:, :, trim:], self.values[:, :, trim:]
            self.idx = self.max_size
        if self.idx >= self.max_size:  # rotate when hitting max
            self.idx = 0
        self.keys[:, :, self.idx:self.idx + 1] = keys
        self.values[:, :, self.idx:self.idx + 1] = values
        self.offset += 1
        self.idx += 1
        valid = min(self.offset, self.max_size)
        return self.keys[:, :, :valid], self.values[:, :, :valid]


def sliding_causal_mask(n, offset, window):
    rinds = torch.arange(offset + n)[None, :]
    linds = torch.arange(offset, offset + n)[:, None]
    return (linds >= rinds) & (linds < rinds + window)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.hd = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache):
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_heads, self.hd).permute(2, 0, 3, 1, 4)
        k, v = cache.update(k, v)
        mask = None
        if l > 1:  # queries are the last l of the returned keys
            mask = sliding_causal_mask(l, k.shape[2] - l, SLIDING_WINDOW)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, l, -1))


class Model(nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(256, dim)
        self.attn = nn.ModuleList([Attention(dim, n_heads) for _ in range(n_layers)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                  for _ in range(n_layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches):
        off = caches[0].offset
        h = self.embed(tokens) + self.pos(torch.arange(off, off + tokens.shape[1]))
        for attn, mlp, c in zip(self.attn, self.mlp, caches):
            h = h + attn(h, c)
            h = h + mlp(h)
        return self.head(self.norm(h))


model = Model().eval()
turn1 = torch.randint(0, 64, (1, 10))
turn2 = torch.randint(0, 64, (1, 4))
with torch.no_grad():
    caches = [RotatingKVCache(SLIDING_WINDOW) for _ in model.attn]
    logits = model(turn1, caches)  # prompt
    toks = [logits[:, -1:].argmax(-1)]
    for _ in range(3):  # decode: the ring buffer wraps
        toks.append(model(toks[-1], caches)[:, -1:].argmax(-1))
    seen = torch.cat([turn1] + toks[:-1], 1)  # the tokens the cache holds
    out = model(turn2, caches)  # next turn: multi-token update on the wrapped cache
    full = torch.cat([seen, turn2], 1)
    ref = model(full, [RotatingKVCache(10 ** 6) for _ in model.attn])[:, -turn2.shape[1]:]
print("cache offset", caches[0].offset, "keys held", caches[0].keys.shape[2])
print("max |turn-2 logits - full-sequence sliding-window reference| = %.5f" % (out - ref).abs().max().item())
