# The ESM-IF1 partial_seq bug (facebookresearch/esm PR #438: tokens the sampler was given are skipped, so they never
# enter the incremental KV cache) written another way: a nanoGPT-style decoder whose forward(idx, cache) is handed the
# whole sequence so far and runs its last token alone, appending that token's keys to a per-layer list cache; a batch
# of two prompts, prefilled causally through SDPA's is_causal, decoded through SDPA. Generation forces the tokens a
# constraint dict fixes (as Whisper's forced_decoder_ids do) by appending them to the sequence without a model call,
# so their keys never reach the cache. The fix runs the model on every token and only overrides its draw.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, layer_cache):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if layer_cache:
            k = torch.cat([layer_cache[0], k], dim=2)
            v = torch.cat([layer_cache[1], v], dim=2)
        layer_cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, dim=32, layers=2, block_size=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, cache):
        start = 0 if not cache[0] else idx.shape[1] - 1  # a cached call runs the last token alone
        pos = torch.arange(start, idx.shape[1])
        x = self.wte(idx[:, start:]) + self.wpe(pos)
        for block, layer_cache in zip(self.blocks, cache):
            x = block(x, layer_cache)
        return self.head(x[:, -1])


@torch.no_grad()
def generate(model, prompt, steps, forced):
    idx = prompt
    cache = [[] for _ in model.blocks]
    logits = model(idx, cache)
    for _ in range(steps):
        position = idx.shape[1]
        if position in forced and not FIXED:
            nxt = torch.full((idx.shape[0], 1), forced[position])  # forced: appended, the model never run on it
            idx = torch.cat([idx, nxt], dim=1)
            continue
        nxt = torch.multinomial(logits.softmax(-1), 1)
        if position in forced:
            nxt[:] = forced[position]
        idx = torch.cat([idx, nxt], dim=1)
        logits = model(idx, cache)
    return idx


model = TinyGPT().eval()
prompt = torch.randint(0, 50, (2, 4))
out = generate(model, prompt, steps=8, forced={6: 7, 7: 11})
print(out.tolist())
