# The bigcode Megatron-LM f1a50a3 bug (decode handed the wrong keys: none of its cache) written another way: a
# hand-written decoder with a static KV cache indexed by `cache_position` (as transformers' StaticCache is) writes each
# step's keys into the cache with index_copy_, but hands the kernel the step's own key states instead of the cache it
# just wrote, so every decode token attends only itself. Eager attention (matmul + softmax), grouped heads, a batch of
# two prompts. The fix attends over the cache's written slots.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
MAX_LEN = 16


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.register_buffer("cache_k", torch.zeros(2, kv_heads, MAX_LEN, self.head_dim), persistent=False)
        self.register_buffer("cache_v", torch.zeros(2, kv_heads, MAX_LEN, self.head_dim), persistent=False)

    def forward(self, x, cache_position):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.cache_k.index_copy_(2, cache_position, k)
        self.cache_v.index_copy_(2, cache_position, v)
        end = int(cache_position[-1]) + 1
        if FIXED:
            k, v = self.cache_k[:, :, :end], self.cache_v[:, :, :end]
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        ahead = torch.arange(k.shape[2])[None, :] > cache_position[:, None]  # key slot after the query's position
        scores = scores.masked_fill(ahead, float("-inf"))
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, vocab=30, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(MAX_LEN, dim)
        self.layers = nn.ModuleList([Attention(dim) for _ in range(2)])

    def forward(self, input_ids, cache_position):
        x = self.embed(input_ids) + self.pos(cache_position)[None]
        for layer in self.layers:
            x = x + layer(x, cache_position)
        return x @ self.embed.weight.t()


model = Model().eval()
prompt = torch.randint(0, 30, (2, 5))
with torch.no_grad():
    logits = model(prompt, torch.arange(5))
    tokens = torch.cat([prompt, logits[:, -1:].argmax(-1)], 1)
    for step in range(5, 9):
        logits = model(tokens[:, -1:], torch.tensor([step]))
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], 1)
    cached = logits[:, -1]
    for layer in model.layers:
        layer.cache_k.zero_(), layer.cache_v.zero_()
    whole = model(tokens[:, :-1], torch.arange(9))[:, -1]
print(f"max |logits(cached decode) - logits(one pass)| = {(cached - whole).abs().max().item():.6f}")
