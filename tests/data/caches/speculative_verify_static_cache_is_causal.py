# Written another way (huggingface/optimum#1416's bug): a speculative decoder verifies a block of draft tokens against a
# preallocated static KV cache, batch 2; its attention hands SDPA is_causal=True whenever more than one token is new,
# which SDPA aligns top-left over (n, past + n) scores, hiding most of the cached prefix from the draft tokens. The fix
# hands the bottom-right causal mask ones(n, past + n).tril(past) instead.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, MAX_LEN, VOCAB = 32, 4, 16, 50


class StaticCache:
    def __init__(self, layers, batch):
        shape = (batch, HEADS, MAX_LEN, DIM // HEADS)
        self.k = [torch.zeros(shape) for _ in range(layers)]
        self.v = [torch.zeros(shape) for _ in range(layers)]
        self.seen = 0

    def update(self, layer, k, v):
        start = self.seen
        self.k[layer][:, :, start:start + k.shape[2]] = k
        self.v[layer][:, :, start:start + k.shape[2]] = v
        return self.k[layer][:, :, :start + k.shape[2]], self.v[layer][:, :, :start + k.shape[2]]


class Attention(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, cache):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        k, v = cache.update(self.index, k, v)
        past = k.shape[2] - n
        if FIXED and n > 1:
            bottom_right = torch.ones(n, past + n, dtype=torch.bool).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, DIM))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList([Attention(i) for i in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, cache):
        x = self.embed(ids) + self.pos(torch.arange(cache.seen, cache.seen + ids.shape[1]))
        for layer in self.layers:
            x = layer(x, cache)
        cache.seen += ids.shape[1]
        return self.head(x)


model = Decoder().eval()
prompt = torch.randint(0, VOCAB, (2, 6))
draft = torch.randint(0, VOCAB, (2, 3))
with torch.no_grad():
    cache = StaticCache(2, 2)
    model(prompt, cache)
    verified = model(draft, cache)  # (2, 3, VOCAB): the target model's logits at every draft position
    full = model(torch.cat([prompt, draft], 1), StaticCache(2, 2))[:, -3:]
print(f"max |verify logits - full pass logits| = {(verified - full).abs().max().item():.6f}")
